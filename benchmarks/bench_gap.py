"""The nearest other token, found by verifying the whole vocabulary, against the calibration's gap between tokens.

The acceptor's rules for lminvert's own states rest on ``gap``: the smallest relative distance the calibration saw
between the true token's state and another candidate's (:mod:`lminvert.invert.tolerance`). Those candidates are a
sample (the true token's nearest input vectors, then random ones), so ``gap`` is not each position's nearest other
token; the acceptor takes a fraction of it
(:data:`lminvert.invert.acceptor.TOKEN_GAP_SAFETY`). This measures how large that fraction has to be: at the chosen
positions of held-out prompts, every token of the vocabulary is put in place of the true one
(:func:`lminvert.invert.nearest.nearest_others`), and its state's distance to the plain forward's is taken.

    python benchmarks/bench_gap.py --layers 1,15,30 --prompts 2 --positions 0,5,14
    python benchmarks/bench_gap.py --model gemma3-270m --dtype bfloat16 --layers 9,18 --prompts 1 --positions 14

Per layer: each position's nearest other token (relative to the state's norm; its input vector's place among the
true token's nearest by angle, as the calibration's hardest candidates are chosen), the calibration's gap, and their
ratio; the largest ratio is what the fraction must cover. Exit status 1 where a ratio exceeds
``TOKEN_GAP_SAFETY``."""

from __future__ import annotations

import argparse
import sys
import time

import torch

import lminvert
from heldout import FRESH
from lminvert.invert.acceptor import TOKEN_GAP_SAFETY
from lminvert.invert.nearest import near_inputs, nearest_others
from lminvert.invert.tolerance import calibrate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", default="1,15,30")
    parser.add_argument("--prompts", type=int, default=2, help="the first N of heldout.FRESH")
    parser.add_argument("--skip", type=int, default=0, help="start at this prompt of heldout.FRESH")
    parser.add_argument("--positions", default="0,5,14")
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()

    model = lminvert.load_model(args.model, dtype=args.dtype)
    probe = model.probe
    layers = [probe.layer(int(x)) for x in args.layers.split(",")]
    gaps = {layer: calibrate(model, layer).gap for layer in layers}
    positions = [int(x) for x in args.positions.split(",")]
    texts = FRESH[args.skip : args.skip + args.prompts]
    print(f"{args.model} {args.dtype}, vocabulary {probe.vocab_size}, TOKEN_GAP_SAFETY {TOKEN_GAP_SAFETY}")
    worst = {layer: 0.0 for layer in layers}
    for k, text in enumerate(texts):
        prompt = list(model.tokenize(text, args.length))
        for t in positions:
            if t >= len(prompt):
                continue
            start = time.perf_counter()
            found = nearest_others(model, prompt, t, layers, args.chunk)
            seconds = time.perf_counter() - start
            by_angle = near_inputs(model, torch.tensor([prompt[t]]), probe.vocab_size)[0].tolist()
            for layer in layers:
                near, other, own = found[layer].distance, found[layer].token, found[layer].own
                ratio = gaps[layer] / near
                worst[layer] = max(worst[layer], ratio)
                print(
                    f"prompt {args.skip + k} position {t:2d} layer {int(layer):2d}: nearest other token {other} at "
                    f"{near:.4g} of the norm (true token cached {own:.2g}; its input vector the true one's "
                    f"{_place(by_angle, other)} nearest by angle); calibration gap {gaps[layer]:.4g}: ratio "
                    f"{ratio:.3g}  [{seconds:.0f} s]"
                )
            sys.stdout.flush()
    for layer in layers:
        print(f"layer {int(layer):2d}: largest calibration gap / nearest other token {worst[layer]:.3g}")
    return int(max(worst.values()) > TOKEN_GAP_SAFETY)


def _place(order: list[int], token: int) -> str:
    """``token``'s place in ``order`` (1st, 2nd, ...; "not" for a tied twin, left out of the order)."""
    if token not in order:
        return "not (a tied twin)"
    n = order.index(token) + 1
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


if __name__ == "__main__":
    sys.exit(main())
