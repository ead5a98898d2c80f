"""Leaks as people save them in half precision, each through ``lminvert invert FILE --model M [--layer L] --json``
(the command itself, in this process), with no ``--dtype`` unless the form names one.

Forms (``--forms``), for held-out prompts of ``--length`` tokens at layer (block) ``--layer``:

* ``bf16-pt``: a bfloat16 model's ``hidden_states[L]`` saved as it is, ``[1, T, d]`` (``torch.save``);
* ``bf16-npy``: the same as float32 ``.npy`` (numpy has no bfloat16);
* ``fp16-npy``: a float16 model's, as float32 ``.npy``;
* ``cast-bf16``: a float32 model's states cast to bfloat16 to be saved (another leak: what the tool says about it);
* ``cast-bf16-named``: the same with ``--dtype float32 --source quant:bf16``;
* ``cast-fp16``: a float32 model's states cast to float16 (``torch.save``);
* ``kv-bf16-f32``: a bfloat16 model's KV cache saved as float32 (keys, values) pairs, ``--leak kv``;
* ``kv-cast-bf16``: a float32 model's KV cache cast to bfloat16 pairs to be saved, ``--leak kv``.

Printed per form: the dtype the command ran in, tokens right, positions claimed (``certified`` / ``confident``), claimed
tokens that are wrong (must be 0), how many prompts got the cast hint, and the median and slowest seconds the command
reported. This CPU.

    python benchmarks/bench_saved.py                          # every form, 6 prompts of 20 tokens, layer 15
    python benchmarks/bench_saved.py --forms bf16-npy,kv-bf16-f32 --prompts 2 --layer 22
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import lminvert
from heldout import FRESH, HELD_OUT
from lminvert.cli import main as cli

FORMS = (
    "bf16-pt", "bf16-npy", "fp16-npy", "cast-bf16", "cast-bf16-named", "cast-fp16", "kv-bf16-f32", "kv-cast-bf16"
)  # fmt: skip
CLAIMED = ("certified", "confident")
HINT = "--source quant:"


def _save(models: dict, form: str, ids: list[int], layer: int, path: Path) -> list[str]:
    """Save ``ids``' leak in ``form`` at ``path``; the command's extra arguments."""
    casts = ("cast-bf16", "cast-bf16-named", "cast-fp16", "kv-cast-bf16")
    dtype = "float16" if form == "fp16-npy" else "float32" if form in casts else "bfloat16"
    model = models.setdefault(dtype, lminvert.load_model("smollm2-135m", dtype=dtype))
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), use_cache=True, output_hidden_states=True)
    hidden = out.hidden_states[layer]
    if form.startswith("kv-"):
        saved = torch.bfloat16 if form == "kv-cast-bf16" else torch.float32
        torch.save([(entry.keys.to(saved), entry.values.to(saved)) for entry in out.past_key_values.layers], path)
        return ["--leak", "kv"]
    if form == "bf16-pt":
        torch.save(hidden, path)
    elif form.endswith("-npy"):
        np.save(path, hidden[0].float().numpy())
    elif form == "cast-fp16":
        torch.save(hidden.half(), path)
    else:
        torch.save(hidden.bfloat16(), path)
    return ["--dtype", "float32", "--source", "quant:bf16"] if form == "cast-bf16-named" else []


def _invert(path: Path, layer: int, extra: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    args = ["invert", str(path), "--model", "smollm2-135m", "--layer", str(layer), "--json", *extra]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(args)
    if code != 0:
        raise SystemExit(f"lminvert {' '.join(args)} failed ({code}): {err.getvalue().strip()}")
    (doc,) = json.loads(out.getvalue())
    return doc


def _hinted(path: Path, layer: int, extra: list[str]) -> bool:
    """Whether the command without ``--json`` (which prints no hints) names a cast."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cli(["invert", str(path), "--model", "smollm2-135m", "--layer", str(layer), *extra])
    return HINT in err.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--set", choices=("held_out", "fresh"), default="held_out")
    args = parser.parse_args()
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    texts = HELD_OUT if args.set == "held_out" else FRESH
    if unknown or args.prompts > len(texts):  # refused before any model is loaded
        parser.error(f"unknown forms {unknown} (use {', '.join(FORMS)})" if unknown else f"--set holds {len(texts)}")
    models: dict[str, lminvert.LoadedModel] = {}
    tokenizer = models["float32"] = lminvert.load_model("smollm2-135m")
    prompts = [list(tokenizer.tokenize(t, args.length)) for t in texts[: args.prompts]]
    wrong_anywhere = 0
    print("| form | ran in | tokens | claimed | wrong claimed | cast hint | median s | slowest s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for form in forms:
            suffix = ".npy" if form.endswith("-npy") else ".pt"
            path = Path(tmp) / f"{form}{suffix}"
            extra = _save(models, form, prompts[0][:4], args.layer, path)  # one-time builds, untimed
            _invert(path, args.layer, extra)
            right = claimed = wrong = hinted = 0
            seconds, dtypes = [], set()
            for ids in prompts:
                extra = _save(models, form, ids, args.layer, path)
                doc = _invert(path, args.layer, extra)
                verdicts = doc["verdicts"]
                hits = [a == b for a, b in zip(doc["token_ids"], ids, strict=True)]
                right += sum(hits)
                claimed += sum(v in CLAIMED for v in verdicts)
                wrong += sum(v in CLAIMED and not h for v, h in zip(verdicts, hits, strict=True))
                seconds.append(doc["seconds"])
                dtypes.add(doc["dtype"])
                if verdicts.count("uncertain") * 2 >= len(verdicts):
                    hinted += _hinted(path, args.layer, extra)
            wrong_anywhere += wrong
            total = sum(map(len, prompts))
            print(
                f"| {form} | {'/'.join(sorted(dtypes))} | {right}/{total} | {100 * claimed / total:.1f}% | {wrong} | "
                f"{hinted}/{len(prompts)} | {statistics.median(seconds):.2f} | {max(seconds):.2f} |",
                flush=True,
            )
    print(f"SmolLM2, layer {args.layer}, {args.prompts} prompts of {args.length} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, cpu")  # fmt: skip
    return 0 if wrong_anywhere == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
