"""The scout against the search without it, in one process: each held-out prompt inverted both ways in turn (the
order alternating), as ``lminvert invert`` runs it (:func:`lminvert.invert` with the defaults, then ``scout=False``).

``--together N``: N prompts at a time (each chunk's seconds split evenly). Printed per layer: prompts exact and
positions sure each way, whether every prompt got the same tokens and verdicts both ways, the median and mean seconds
per prompt each way and their ratio, and how many prompts the scout's guess decided whole (every position decided on
the state given for its guess).
This CPU unless ``--device``; a prepared
cache (``lminvert models --prepare smollm2-135m``) is what a user's machine has.

    python benchmarks/bench_scout.py --layers 30,15,9,1 --prompts 12
    python benchmarks/bench_scout.py --layers 30 --set fresh --prompts 16
    python benchmarks/bench_scout.py --layers 30 --prompts 16 --together 8
    python benchmarks/bench_scout.py --layers 30,15 --prompts 8 --capture right
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import lminvert
from heldout import DEEP, FRESH
from lminvert.invert.layouts import padded_states

SURE = ("certified", "confident")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="30,15")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--set", choices=("deep", "fresh"), default="deep", help="heldout.DEEP or FRESH")
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--together", type=int, default=1, help="prompts inverted at once (seconds split evenly)")
    parser.add_argument(
        "--capture",
        choices=("own", "right", "left"),
        default="own",
        help="the states: lminvert's own (encode), or one padded transformers batch (right or left padding; prompts "
        "cut by 0-3 tokens so that it pads), each prompt's rows inverted as a bare array with source='float'",
    )
    args = parser.parse_args()
    model = lminvert.load_model(args.model, dtype=args.dtype, device=args.device)
    texts = FRESH if args.set == "fresh" else DEEP
    prompts = [list(model.tokenize(t, args.length)) for t in texts[: args.prompts]]
    if args.capture != "own":
        prompts = [ids[: len(ids) - i % 4] for i, ids in enumerate(prompts)]
    head = ("layer", 6), ("exact", 11), ("sure %", 13), ("same", 5), ("median s", 13), ("mean s", 13), ("ratio", 6)
    print(" ".join(f"{name:>{width}}" for name, width in head), f"{'whole':>6}")
    wrong = 0
    for spec in args.layers.split(","):
        layer = model.probe.layer(spec)
        if args.capture == "own":
            chunks = [prompts[i : i + args.together] for i in range(0, len(prompts), args.together)]
            states, options = [lminvert.encode(model, chunk, layer) for chunk in chunks], {}
        else:  # rows of one padded batch, as a deployment captures them
            rows = padded_states(model.probe, layer, prompts, args.capture)
            states = [r[None].to(model.probe.dtype) for r in rows]
            options = {"layer": layer, "source": "float"}
        lminvert.invert(model, states[0], **options)  # what the layer builds once (tables, radii), not timed
        seconds, results = {True: [], False: []}, {True: [], False: []}
        for i, s in enumerate(states):
            for scout in (True, False) if i % 2 == 0 else (False, True):
                start = time.perf_counter()
                found = lminvert.invert(model, s, scout=None if scout else False, together=args.together, **options)
                seconds[scout] += [(time.perf_counter() - start) / len(found)] * len(found)
                results[scout] += found
        exact = {k: sum(r.token_ids == ids for r, ids in zip(v, prompts, strict=True)) for k, v in results.items()}
        sure = {k: 100 * statistics.mean(p.verdict in SURE for r in v for p in r.positions) for k, v in results.items()}
        same = all(
            a.token_ids == b.token_ids and [p.verdict for p in a.positions] == [p.verdict for p in b.positions]
            for a, b in zip(results[True], results[False], strict=True)
        )
        wrong += sum(
            p.verdict in SURE and p.token_id != ids[t]
            for v in results.values()
            for r, ids in zip(v, prompts, strict=True)
            for t, p in enumerate(r.positions)
        )
        whole = sum(all(p.speculated for p in r.positions) for r in results[True])
        med = {k: statistics.median(v) for k, v in seconds.items()}
        mean = {k: statistics.mean(v) for k, v in seconds.items()}
        print(
            f"{layer.name:>6} {exact[True]:>2}/{len(prompts)} {exact[False]:>2}/{len(prompts)} "
            f"{sure[True]:>6.1f} {sure[False]:>6.1f} {'yes' if same else 'NO':>5} {med[True]:>6.2f} {med[False]:>6.2f} "
            f"{mean[True]:>6.2f} {mean[False]:>6.2f} {med[True] / med[False]:>6.2f} {whole:>3}/{len(prompts)}",
            flush=True,
        )
    print("columns: with the scout (the default), then without it (scout=False); ratio: medians with / without")
    print(f"device: {model.probe.device} ({model.dtype}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
