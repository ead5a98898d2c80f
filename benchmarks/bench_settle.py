"""Layers the fit's scores cannot tell apart, settled by position 0 (``lminvert.invert.layerfit.settle``), on SmolLM2
captures of one prompt each, as a user captures them (transformers' ``hidden_states[L]``, no layer recorded):

    python benchmarks/bench_settle.py                       # 8 HELD_OUT + 12 FRESH texts, 10 layers, both dtypes
    python benchmarks/bench_settle.py --layers 13,15 --dtypes bfloat16

Each capture (20 tokens) is scored against every layer under the ``float`` source, as ``lminvert invert`` scores a
capture from elsewhere. Prints per dtype the captures, those the scores alone do not decide (``cannot tell which
layer ... pass --layer`` before ``settle``), and of those how many position 0 settled on the right layer, on a wrong
one (never expected: the states' own layer always holds its token's state), or left unsettled; and the seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

import lminvert
from heldout import FRESH, HELD_OUT
from lminvert.invert.layerfit import fit_layers, settle
from lminvert.invert.sources import Float


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,3,8,13,14,15,16,22,27,29")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--length", type=int, default=20)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    texts = [*HELD_OUT, *FRESH[:12]]
    for dtype in args.dtypes.split(","):
        model = lminvert.load_model("smollm2-135m", dtype=dtype)
        counts = dict.fromkeys(("captures", "not decisive", "settled right", "settled wrong", "unsettled"), 0)
        start = time.perf_counter()
        for text in texts:
            ids = model.tokenizer(text, return_tensors="pt").input_ids[:, : args.length]
            with torch.no_grad():
                hidden = model.model(ids, output_hidden_states=True).hidden_states
            for layer in layers:
                states = [hidden[layer][0]]
                fit = fit_layers(model, states, Float())
                counts["captures"] += 1
                if fit.decisive:
                    assert fit.best == str(layer), fit.describe()  # a decisive wrong call: the fit's own bug
                    continue
                counts["not decisive"] += 1
                settled = settle(model, states, fit, Float())
                key = (
                    "unsettled"
                    if not settled.decisive
                    else "settled " + ("right" if settled.best == str(layer) else "wrong")
                )
                counts[key] += 1
                print(f"  {dtype} layer {layer}: {key}: {settled.describe()}", flush=True)
        seconds = time.perf_counter() - start
        print(
            f"{dtype}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"; {seconds:.0f} s (tables built once)"
        )


if __name__ == "__main__":
    main()
