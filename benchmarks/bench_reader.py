"""Reading networks trained with different options: training time, and how high each ranks the true token of
held-out prompts' positions (the linear reading map alongside). Nothing is cached.

    python benchmarks/bench_reader.py --layer 9 --variants "bfloat16=False;bfloat16=True"
    python benchmarks/bench_reader.py --layer 30 --base "negatives=0,random=4000" \
        --variants "bfloat16=True;bfloat16=False"

Each variant is keyword arguments of ``train_reader`` (``--base``: those shared by all); the training prompts' states
are computed once per ``--states`` (``float32``: a plain forward; ``bfloat16``: its products in bfloat16, as the
preparation's quick network trains where those are native; each forward timed), and every variant is trained on each.
Held out: 20 random-id prompts of 20 tokens, the text windows of 40 sampled mixed prompts of at most 20 tokens (those
of at least 10), and the deep benchmark's held-out texts (``heldout.DEEP``, 20 tokens), positions 1 on; per kind the
median rank of the true token among the vocabulary by the proposal's distance, the mean log2(2 + rank), and the
fractions at rank 0, below 8 and below 64.

    python benchmarks/bench_reader.py --layer 30 --base "text=1000,random=500,hidden=1024,negatives=2048,lr=3e-3" \
        --states float32,bfloat16 --variants "epochs=9"
"""

import argparse
import ast
import math
import statistics
import time

import torch

import lminvert
from heldout import DEEP
from lminvert.corpora import sample_prompts
from lminvert.forward import prompt_states
from lminvert.invert import reader
from lminvert.invert.reading import reading_map


def options(text: str) -> dict:
    """``"a=1,b=True"`` as keyword arguments (literal values only)."""
    call = ast.parse(f"f({text})", mode="eval").body
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument(
        "--variants", required=True, help="';'-separated train_reader options, e.g. 'epochs=3;hidden=1024'"
    )
    parser.add_argument("--base", default="", help="train_reader options shared by every variant")
    parser.add_argument(
        "--states", default="float32", help="the training prompts' forwards: float32 and/or bfloat16 (comma-separated)"
    )
    args = parser.parse_args()
    if not set(args.states.split(",")) <= {"float32", "bfloat16"}:
        parser.error(f"--states takes float32 and/or bfloat16, not {args.states!r}")
    model = lminvert.load_model(args.model)
    layer = model.probe.layer(args.layer)
    base, variants = options(args.base), [options(v) for v in args.variants.split(";")]
    gen = torch.Generator().manual_seed(999)
    held = {"random": torch.randint(0, model.probe.vocab_size, (20, 20), generator=gen).tolist()}
    windows, _ = sample_prompts(model.tokenizer, "mixed", 40, max_tokens=20, seed=777)
    held["text"] = [list(p.ids) for p in windows if len(p.ids) >= 10]
    held["deep"] = [list(model.tokenize(text, 20)) for text in DEEP]
    observed = {
        kind: [s[layer] for s in prompt_states(model, ps, [layer], progress=False)] for kind, ps in held.items()
    }

    def show(name: str, weights, seconds: float) -> None:
        parts = []
        for kind, prompts in held.items():
            ranks = reader.held_out_ranks(model, weights, prompts, observed[kind])
            log2 = statistics.mean(math.log2(2 + r) for r in ranks)
            top1, top8, top64 = (sum(r < k for r in ranks) / len(ranks) for k in (1, 8, 64))
            median = statistics.median(ranks)
            parts.append(
                f"{kind} median {median:5.0f} log2 {log2:5.2f} top1 {top1:.2f} top8 {top8:.2f} top64 {top64:.2f}"
            )
        print(f"  {name:<40} {seconds:6.0f} s | " + " | ".join(parts), flush=True)

    print(f"{args.model} layer {layer.name}, threads={torch.get_num_threads()}; rank of the true token, held out:")
    show("linear reading map", reading_map(model, layer), 0.0)
    prompts = reader.training_prompts(model, **{k: base[k] for k in ("text", "random", "length", "seed") if k in base})
    for kind in args.states.split(","):
        start = time.perf_counter()
        states = reader.training_states(model, prompts, [layer], {"float32": False, "bfloat16": True}[kind], False)
        seconds = time.perf_counter() - start
        print(f"  forwards of the {len(prompts)} training prompts, {kind}: {seconds:.0f} s", flush=True)
        for variant in variants:
            start = time.perf_counter()
            settings = {**base, **variant}
            net = reader.train_reader(model, layer, progress=False, data=(prompts, states), cache=False, **settings)
            name = f"{kind} states, " + ", ".join(f"{k}={v}" for k, v in variant.items())
            show(name, net, time.perf_counter() - start)


if __name__ == "__main__":
    main()
