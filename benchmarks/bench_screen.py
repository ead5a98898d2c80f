"""Screening's two facts, measured: what one verification forward costs in float32 and screened (bfloat16 GEMMs), and
how far the screened states lie from the float32 ones against the screening radius and the gaps between tokens.

    python benchmarks/bench_screen.py                         # SmolLM2, layers 15 and 30
    python benchmarks/bench_screen.py --model gemma3-270m --layers 9,18

Per layer and batch size: the median of 5 timed calls each way (interleaved, after one warm-up), their ratio, the
largest ||screened - float32|| / ||float32|| over the batch, and the calibrated screening radius (the true token's
measured disagreement times the safety factor, relative to the target's norm) beside the smallest relative distance
between two candidates' float32 states. Candidates are random token ids after a 19-token prose prefix.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lminvert
from lminvert.invert.tolerance import SAFETY, screen_calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="15,30")
    parser.add_argument("--batches", default="16,64,256,512")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = lminvert.load_model(args.model)
    probe = model.probe
    print(f"{args.model} on {probe.device}, {args.threads} threads; can_screen: {probe.can_screen}")
    text = "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp for ships"
    ids = model.tokenize(text)
    gen = torch.Generator().manual_seed(0)
    for spec in args.layers.split(","):
        layer = probe.layer(int(spec))
        prefix = probe.prefix(ids[:19], layer)
        radius = SAFETY * screen_calibration(model, layer)
        print(f"layer {layer}: screening radius {radius:.3g} of the target's norm")
        for batch in (int(b) for b in args.batches.split(",")):
            cands = torch.randperm(probe.vocab_size, generator=gen)[:batch]
            times: dict[bool, list[float]] = {False: [], True: []}
            states = {}
            for _ in range(6):
                for screened in (False, True):
                    start = time.perf_counter()
                    with torch.no_grad(), probe.screening() if screened else torch.no_grad():
                        states[screened] = probe.continuation(prefix, token_ids=cands).float()
                    times[screened].append(1000 * (time.perf_counter() - start))
            exact, fast = (statistics.median(times[s][1:]) for s in (False, True))
            norms = states[False].norm(dim=1)
            error = float(((states[True] - states[False]).norm(dim=1) / norms).max())
            gaps = torch.cdist(states[False], states[False]) / norms[:, None]
            gaps.fill_diagonal_(float("inf"))
            print(
                f"  {batch:>4} candidates: float32 {exact:6.0f} ms, screened {fast:6.0f} ms ({fast / exact:.2f}x); "
                f"screened states within {error:.3g} of the norm; smallest gap between two candidates "
                f"{float(gaps.min()):.3g}"
            )


if __name__ == "__main__":
    main()
