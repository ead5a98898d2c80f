"""Attention sinks after the first position, captured elsewhere: random-id prompts whose position 1 is a sink (its
state's norm over 4 times the median of the later positions'), their states or KV cache computed with transformers'
eager attention (what a capture that asks for attention weights, or another library's attention, computes; lminvert
runs the model's default kernel) and inverted as foreign states (``source="float"``); or (``--capture own``) the
states lminvert computes itself (``lminvert.encode``), inverted as its own (exact source).

    python benchmarks/bench_sinks.py --layer 15 --dtype bfloat16 --prompts 10
    python benchmarks/bench_sinks.py --leak kv --layer 15 --dtype bfloat16 --prompts 8
    python benchmarks/bench_sinks.py --capture own --layer 15 --dtype bfloat16 --prompts 10
    python benchmarks/bench_sinks.py --capture own --layer 15 --ids 40392,36597,8076,19077,16247,6528

Per prompt: whether every token is right, the verdicts, seconds; then the positions claimed (certified or confident)
with a WRONG token, which must be 0 (exit status 1 otherwise). The prompts: the first ``--prompts`` of 600 random-id
prompts of ``--length`` tokens (``--seed``) with a sink at position 1 in the states the leak reads (the KV cache of
block ``b``: layer ``b - 1``'s), or those of ``--ids`` (one prompt's ids, comma-separated)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import lminvert
from bench_leaks import _capture
from lminvert.models.observed import attention
from lminvert.states import HiddenStates

CLAIMED = ("certified", "confident")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--leak", choices=("states", "kv"), default="states")
    parser.add_argument("--layer", type=int, default=15, help="the states' layer, or the KV cache's block")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--capture", choices=("eager", "own"), default="eager", help="foreign eager, or lminvert's")
    parser.add_argument("--ids", default="", help="one prompt's token ids, comma-separated, instead of the pool")
    args = parser.parse_args()
    if args.capture == "own" and args.leak != "states":
        parser.error("--capture own reads states only")

    model = lminvert.load_model(args.model, dtype=args.dtype)
    probe = model.probe
    reads = probe.layer(args.layer if args.leak == "states" else args.layer - 1)
    torch.manual_seed(args.seed)
    pool = torch.randint(0, probe.vocab_size, (600, args.length))
    norms = probe.states(pool, [reads])[reads].float().norm(dim=2)
    sinks = (norms[:, 1] > 4 * norms[:, 2:].median(dim=1).values).nonzero().flatten()[: args.prompts]
    prompts = [[int(i) for i in args.ids.split(",")]] if args.ids else [pool[i].tolist() for i in sinks]
    print(
        f"{args.model} {args.dtype}, {args.leak} at {args.layer}, {args.capture} capture: {len(prompts)} prompts "
        f"{'given' if args.ids else 'with a sink at position 1'}"
    )
    wrong, exact, seconds = 0, 0, []
    for ids in prompts:
        if args.capture == "own":
            leak = lminvert.encode(model, [ids], args.layer)
        else:
            with attention(probe, "eager"):  # transformers' capture, as bench_leaks.py makes it, with eager attention
                leak = HiddenStates.from_array(_capture(model, ids, args.leak, args.layer, None, args.seed).float())
        start = time.perf_counter()
        (result,) = lminvert.invert(model, leak, args.layer, **({"leak": "kv"} if args.leak == "kv" else {}))
        seconds.append(time.perf_counter() - start)
        bad = [t for t, (got, truth) in enumerate(zip(result.token_ids, ids, strict=True)) if got != truth]
        claimed = [t for t in bad if result.verdicts[t] in CLAIMED]
        wrong += len(claimed)
        exact += not bad
        print(
            f"  {'exact' if not bad else f'{len(bad)} wrong'}  {' '.join(v[:4] for v in result.verdicts)}  "
            f"position 1: {result.positions[1].reason}  {seconds[-1]:.1f} s{'  WRONG CLAIMED' if claimed else ''}"
        )
    print(
        f"exact {exact}/{len(prompts)}; median {statistics.median(seconds):.2f} s; wrong tokens claimed "
        f"certified or confident: {wrong}"
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
