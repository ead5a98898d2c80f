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
* ``kv-cast-bf16``: a float32 model's KV cache cast to bfloat16 pairs to be saved, ``--leak kv``;
* ``tf-bf16-pt``: transformers' own bfloat16 model (``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``,
  the converted model's folder), its ``hidden_states[L]``;
* ``tf-kv-bf16``: the same model's KV cache as (keys, values) pairs, ``--leak kv``;
* ``tf-cast-bf16-pt``: transformers' float32 model cast whole after loading (``.to(torch.bfloat16)``, which rounds the
  rotary embedding's frequencies too), its ``hidden_states[L]``;
* ``kv-generate``: the float32 model's ``generate(..., max_new_tokens=12)`` KV cache (the prompt's rows in one
  forward, then one row per step), as (keys, values) pairs, ``--leak kv``: every row's token is counted, the generated
  ones too.

``--chat``: each text as a user's message through the model's chat template (``add_generation_prompt``), not cut.
``--max-seconds S``: passed to every command. ``--cold``: no untimed first run per form, so the first prompt meets the
one-time builds a layer not yet used needs (run on a copy of a prepared cache to see a first run's bound).

Printed per form: the dtype the command ran in, tokens right, positions claimed (``certified`` / ``confident``), claimed
tokens that are wrong (must be 0), how many prompts got the cast hint, and the median and slowest seconds the command
reported. This CPU.

    python benchmarks/bench_saved.py                          # every form, 6 prompts of 20 tokens, layer 15
    python benchmarks/bench_saved.py --forms bf16-npy,kv-bf16-f32 --prompts 2 --layer 22
    python benchmarks/bench_saved.py --forms tf-bf16-pt,tf-kv-bf16,tf-cast-bf16-pt --chat --prompts 8
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
from transformers import AutoModelForCausalLM

import lminvert
from heldout import FRESH, HELD_OUT
from lminvert.cli import main as cli

FORMS = (
    "bf16-pt", "bf16-npy", "fp16-npy", "cast-bf16", "cast-bf16-named", "cast-fp16", "kv-bf16-f32", "kv-cast-bf16",
    "tf-bf16-pt", "tf-kv-bf16", "tf-cast-bf16-pt", "kv-generate",
)  # fmt: skip
GENERATED = 12  # tokens kv-generate's generate() adds
CLAIMED = ("certified", "confident")
HINT = "--source quant:"


def _network(models: dict, form: str) -> torch.nn.Module:
    """The transformers model that computes ``form``'s leak: lminvert's, or (``tf-``) one transformers loads itself."""
    if form.startswith("tf-"):
        key = "tf-cast" if "cast" in form else "tf-bfloat16"
        if key not in models:
            folder = models["float32"].model.name_or_path  # the converted model's folder
            if key == "tf-cast":  # .to() rounds every floating buffer, the rotary frequencies too
                models[key] = AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).eval()
            else:
                models[key] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        return models[key]
    casts = ("cast-bf16", "cast-bf16-named", "cast-fp16", "kv-cast-bf16", "kv-generate")
    dtype = "float16" if form == "fp16-npy" else "float32" if form in casts else "bfloat16"
    return models.setdefault(dtype, lminvert.load_model("smollm2-135m", dtype=dtype)).model


def _save(models: dict, form: str, ids: list[int], layer: int, path: Path) -> tuple[list[str], list[int]]:
    """Save ``ids``' leak in ``form`` at ``path``; the command's extra arguments and the tokens its rows hold."""
    if form == "kv-generate":
        with torch.no_grad():
            out = _network(models, form).generate(
                torch.tensor([ids]), max_new_tokens=GENERATED, do_sample=False, return_dict_in_generate=True
            )
        layers = out.past_key_values.layers
        torch.save([(entry.keys, entry.values) for entry in layers], path)
        return ["--leak", "kv"], out.sequences[0, : layers[0].keys.shape[2]].tolist()
    with torch.no_grad():
        out = _network(models, form)(input_ids=torch.tensor([ids]), use_cache=True, output_hidden_states=True)
    hidden = out.hidden_states[layer]
    if form.startswith(("kv-", "tf-kv-")):
        saved = torch.bfloat16 if form == "kv-cast-bf16" else torch.float32
        torch.save([(entry.keys.to(saved), entry.values.to(saved)) for entry in out.past_key_values.layers], path)
        return ["--leak", "kv"], ids
    if form in ("bf16-pt", "tf-bf16-pt", "tf-cast-bf16-pt"):
        torch.save(hidden, path)
    elif form.endswith("-npy"):
        np.save(path, hidden[0].float().numpy())
    elif form == "cast-fp16":
        torch.save(hidden.half(), path)
    else:
        torch.save(hidden.bfloat16(), path)
    return (["--dtype", "float32", "--source", "quant:bf16"] if form == "cast-bf16-named" else []), ids


def _prompt(model: lminvert.LoadedModel, text: str, length: int, chat: bool) -> list[int]:
    """``text``'s first ``length`` tokens, or (``chat``) all of it as a user's message in the chat template."""
    if not chat:
        return list(model.tokenize(text, length))
    message = [{"role": "user", "content": text}]
    templated = model.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    return list(model.tokenize(templated))


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
    parser.add_argument("--chat", action="store_true", help="each text as a user's message in the chat template")
    parser.add_argument("--max-seconds", type=float, default=None, help="passed to every command")
    parser.add_argument("--cold", action="store_true", help="no untimed first run per form (one-time builds timed)")
    args = parser.parse_args()
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    texts = HELD_OUT if args.set == "held_out" else FRESH
    if unknown or args.prompts > len(texts):  # refused before any model is loaded
        parser.error(f"unknown forms {unknown} (use {', '.join(FORMS)})" if unknown else f"--set holds {len(texts)}")
    models: dict[str, lminvert.LoadedModel] = {}
    tokenizer = models["float32"] = lminvert.load_model("smollm2-135m")
    prompts = [_prompt(tokenizer, t, args.length, args.chat) for t in texts[: args.prompts]]
    wrong_anywhere = 0
    print("| form | ran in | tokens | claimed | wrong claimed | cast hint | median s | slowest s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        bound = ["--max-seconds", str(args.max_seconds)] if args.max_seconds else []
        for form in forms:
            suffix = ".npy" if form.endswith("-npy") else ".pt"
            path = Path(tmp) / f"{form}{suffix}"
            if not args.cold:
                extra, _ = _save(models, form, prompts[0][:4], args.layer, path)  # one-time builds, untimed
                _invert(path, args.layer, extra + bound)
            right = claimed = wrong = hinted = total = 0
            seconds, dtypes = [], set()
            for ids in prompts:
                extra, truth = _save(models, form, ids, args.layer, path)
                extra += bound
                doc = _invert(path, args.layer, extra)
                verdicts = doc["verdicts"]
                hits = [a == b for a, b in zip(doc["token_ids"], truth, strict=True)]
                total += len(truth)
                right += sum(hits)
                claimed += sum(v in CLAIMED for v in verdicts)
                wrong += sum(v in CLAIMED and not h for v, h in zip(verdicts, hits, strict=True))
                seconds.append(doc["seconds"])
                dtypes.add(doc["dtype"])
                if verdicts.count("uncertain") * 2 >= len(verdicts):
                    hinted += _hinted(path, args.layer, extra)
            wrong_anywhere += wrong
            print(
                f"| {form} | {'/'.join(sorted(dtypes))} | {right}/{total} | {100 * claimed / total:.1f}% | {wrong} | "
                f"{hinted}/{len(prompts)} | {statistics.median(seconds):.2f} | {max(seconds):.2f} |",
                flush=True,
            )
    size = f"{min(map(len, prompts))}-{max(map(len, prompts))} (chat-templated)" if args.chat else args.length
    print(f"SmolLM2, layer {args.layer}, {args.prompts} prompts of {size} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, cpu")  # fmt: skip
    return 0 if wrong_anywhere == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
