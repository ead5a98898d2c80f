"""Every layer at the speed of the middle: a model's one-time preparation, then held-out prompts inverted layer by
layer as a new user runs them (``lminvert encode``, then ``lminvert invert``: :func:`lminvert.encode`,
:func:`lminvert.invert` with the defaults).

    python benchmarks/bench_deep.py --fresh                       # an empty cache: the preparation timed first
    python benchmarks/bench_deep.py --layers 30 --prompts 8       # the cache as it is

``--fresh`` points ``LMINVERT_CACHE`` at a new empty folder and times ``lminvert models --prepare MODEL`` there (the
conversion of the model and everything the preparation makes). Per layer, printed: the first prompt's seconds (what
the layer builds on first use that the preparation did not make is in it), then over every prompt (the first
included): prompts exact, positions sure (``certified`` or ``confident``), tokens claimed sure that are wrong (must be
0), median and slowest seconds, candidates verified per position (median / mean), and the layer's median over layer
15's (or the middle layer's) in the same run. This CPU unless ``--device``; the held-out texts: ``heldout.DEEP``
(``--set fresh``: ``heldout.FRESH``; ``--set starts``: ``heldout.STARTS``, openings without a BOS token).

``--ab-fused``: each layer again without the proposal's fused source (the next-token prior and the reading combined as
a product of experts, :mod:`lminvert.invert.proposal`), in the same run.

``--versus MODEL:LAYER`` (e.g. ``--model gemma3-270m --layers 18 --versus smollm2-135m:30``): after the layers, the
same texts inverted at the first of ``--layers`` and at that model's layer, prompt by prompt alternately in one process
(each model's tokenizer; an untimed first inversion of a few positions on each first), with the ratio of the medians:
two models compared under the same drift of the machine, not in runs minutes apart.

``--reference N``: the reference SIPIT (:func:`lminvert.invert.reference.reference_invert`, the paper's Algorithm 1:
the whole vocabulary in a random order, ``--reference-batch`` candidates per plain forward) on the first ``N`` prompts
at each layer, same run; printed: its median seconds, exact prompts, and the median ratio over lminvert's on the same
prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from heldout import DEEP, FRESH, STARTS

SURE = ("certified", "confident")
SETS = {"deep": DEEP, "fresh": FRESH, "starts": STARTS}
WARM = 4  # positions of the untimed first inversion of each model (--versus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="1,15,27,28,29,30")
    parser.add_argument("--prompts", type=int, default=len(DEEP))
    parser.add_argument("--set", choices=tuple(SETS), default="deep", help="heldout.DEEP, FRESH or STARTS")
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--together", type=int, default=1, help="prompts inverted at once (1: one at a time)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="each inversion's time bound (lminvert.invert's max_seconds)"
    )
    parser.add_argument("--fresh", action="store_true", help="an empty cache, and the preparation timed")
    parser.add_argument(
        "--ab", action="store_true", help="each layer also with the linear reading map alone (no network), same run"
    )
    parser.add_argument(
        "--ab-fused", action="store_true",
        help="each layer also without the proposal's fused source (lminvert.invert.linear.FUSED = 0), same run",
    )  # fmt: skip
    parser.add_argument("--reference", type=int, default=0, help="prompts per layer for the reference SIPIT")
    parser.add_argument("--reference-batch", type=int, default=256, help="the reference's candidates per forward")
    parser.add_argument(
        "--versus", default=None,
        help="MODEL:LAYER: the first of --layers against that model's layer, prompt by prompt alternately, same run",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    report: dict = {"model": args.model, "dtype": args.dtype, "together": args.together}
    if args.fresh:
        os.environ["LMINVERT_CACHE"] = tempfile.mkdtemp(prefix="lminvert-fresh-")
        start = time.perf_counter()
        command = [sys.executable, "-m", "lminvert", "models", "--prepare", args.model, "--dtype", args.dtype]
        made = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
        report["prepare_s"] = time.perf_counter() - start
        report["prepared"] = made
        print(f"lminvert models --prepare {args.model} on an empty cache: {report['prepare_s']:.1f} s", flush=True)
        print("\n".join(f"    {line}" for line in made), flush=True)

    import lminvert  # after LMINVERT_CACHE is set
    from lminvert.invert.reading import reading_map

    model = lminvert.load_model(args.model, dtype=args.dtype, device=args.device)
    texts = SETS[args.set]
    prompts = [list(model.tokenize(t, args.length)) for t in texts[: args.prompts]]
    print(f"{'layer':>9} {'first s':>8} {'exact':>6} {'sure':>6} {'wrong':>5} {'median s':>8} {'max s':>7} {'c/p':>11}")
    rows = {}

    def measure(layer) -> dict:
        return _layer(lminvert, model, layer, prompts, args.together, args.max_seconds)

    for spec in args.layers.split(","):
        layer = model.probe.layer(spec)
        rows[layer.name] = row = measure(layer)
        _show(layer.name, row, len(prompts))
        if args.ab:
            from lminvert.invert import engine

            network = engine.reading_for
            engine.reading_for = reading_map  # the linear map alone: what a machine without any network reads with
            try:
                rows[f"{layer.name} map"] = plain = measure(layer)
            finally:
                engine.reading_for = network
            _show(f"{layer.name} map", plain, len(prompts))
        if args.ab_fused:
            from lminvert.invert import linear

            fused = linear.FUSED
            linear.FUSED = 0.0  # the next-token and reading orders alone, merged place by place
            try:
                rows[f"{layer.name} unfused"] = plain = measure(layer)
            finally:
                linear.FUSED = fused
            _show(f"{layer.name} unfused", plain, len(prompts))
        if args.reference:
            row["reference"] = _reference(lminvert, model, layer, prompts[: args.reference], args.reference_batch)
            ratio = row["reference"]["median"] / statistics.median(row["seconds"][: args.reference])
            print(
                f"{'':>9} reference SIPIT, {args.reference} prompt(s): median {row['reference']['median']:.2f} s, "
                f"{row['reference']['exact']}/{args.reference} exact; lminvert {ratio:.0f}x faster on them",
                flush=True,
            )
    if args.versus:
        first = model.probe.layer(args.layers.split(",")[0])
        report["versus"] = _versus(lminvert, model, first, texts[: args.prompts], args.versus, args)
    middle = rows.get("15") or rows.get(str(model.probe.n_layers // 2))
    if middle:
        ratios = ", ".join(f"{name}: {row['median'] / middle['median']:.2f}x" for name, row in rows.items())
        print(f"median over the middle layer's: {ratios}")
    print(f"device: {model.probe.device} ({model.dtype}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    report["layers"] = rows
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if all(r["wrong_claimed"] == 0 for r in rows.values()) else 1


def _show(name: str, row: dict, prompts: int) -> None:
    print(
        f"{name:>9} {row['first']:>8.2f} {row['exact']:>3}/{prompts:<2} {100 * row['sure']:>5.1f}% "
        f"{row['wrong_claimed']:>5} {row['median']:>8.2f} {row['max']:>7.2f} "
        f"{row['cp_median']:>5.0f}/{row['cp_mean']:<5.1f}",
        flush=True,
    )


def _layer(lminvert, model, layer, prompts: list[list[int]], together: int, max_seconds: float | None) -> dict:
    """Every prompt encoded at ``layer`` and inverted, ``together`` at a time; each chunk's seconds split evenly."""
    seconds, results = [], []
    for first in range(0, len(prompts), together):
        took, got = _run(lminvert, model, layer, prompts[first : first + together], together, max_seconds)
        seconds += took
        results += got
    return _figures(seconds, results, prompts)


def _run(
    lminvert, model, layer, chunk: list[list[int]], together: int, max_seconds: float | None = None
) -> tuple[list[float], list]:
    """``chunk`` encoded at ``layer`` and inverted in one call: each prompt's share of the seconds, the results."""
    states = lminvert.encode(model, chunk, layer)
    start = time.perf_counter()
    got = lminvert.invert(model, states, together=together, max_seconds=max_seconds)
    took = time.perf_counter() - start
    return [took / len(chunk)] * len(chunk), got


def _figures(seconds: list[float], results: list, prompts: list[list[int]]) -> dict:
    """A row's figures (see the module docstring) from every prompt's seconds and result."""
    per_position = [c for r in results for c in r.candidates_checked]
    hits = [[a == b for a, b in zip(r.token_ids, ids, strict=True)] for r, ids in zip(results, prompts, strict=True)]
    pairs = [(v, h) for r, hs in zip(results, hits, strict=True) for v, h in zip(r.verdicts, hs, strict=True)]
    return {
        "first": seconds[0], "exact": sum(all(h) for h in hits), "sure": sum(v in SURE for v, _ in pairs) / len(pairs),
        "wrong_claimed": sum(v in SURE and not h for v, h in pairs),
        "median": statistics.median(seconds), "max": max(seconds), "seconds": seconds,
        "cp_median": statistics.median(per_position), "cp_mean": statistics.mean(per_position),
    }  # fmt: skip


def _versus(lminvert, model, layer, texts: list[str], spec: str, args) -> dict:
    """``--versus MODEL:LAYER``: each text inverted at ``layer`` of ``model`` and at that model's layer, one after the
    other in this process (which goes first alternates from text to text; with ``--together N``, from one call of N
    texts to the next), so that the machine's drift hits both alike; first, untimed, the first text's first positions
    once on each (what a first call pays)."""
    name, _, its = spec.rpartition(":")
    other = lminvert.load_model(name, dtype=args.dtype, device=args.device)
    sides = [(model, layer), (other, other.probe.layer(its))]
    prompts = [[list(m.tokenize(t, args.length)) for t in texts] for m, _ in sides]
    for (m, at), ids in zip(sides, prompts, strict=True):
        _run(lminvert, m, at, [ids[0][:WARM]], 1)
    seconds: list[list[float]] = [[], []]
    results: list[list] = [[], []]
    size = max(1, args.together)  # --together N: N prompts in one call on each side, the calls alternating
    for n, i in enumerate(range(0, len(texts), size)):
        for side in (0, 1) if n % 2 == 0 else (1, 0):
            took, got = _run(lminvert, *sides[side], prompts[side][i : i + size], size, args.max_seconds)
            seconds[side] += took
            results[side] += got
    rows = [_figures(seconds[k], results[k], prompts[k]) for k in (0, 1)]
    for (m, at), row in zip(sides, rows, strict=True):
        _show(f"{m.name.split('-')[0]}:{at.name}", row, len(texts))
    ratio = rows[0]["median"] / rows[1]["median"]
    print(f"median of {model.name} layer {layer.name} over {name} layer {its}'s, same run, alternating: {ratio:.2f}x")
    return {"versus": spec, "rows": rows, "ratio": ratio}


def _reference(lminvert, model, layer, prompts: list[list[int]], batch: int) -> dict:
    """The reference SIPIT on each prompt's states at ``layer``: seconds and exactness."""
    from lminvert.invert.reference import reference_invert

    seconds, exact = [], 0
    for ids in prompts:
        states = lminvert.encode(model, [ids], layer).states[0]
        start = time.perf_counter()
        got = reference_invert(model, states, layer, batch=batch)
        seconds.append(time.perf_counter() - start)
        exact += got.token_ids == ids
    return {"median": statistics.median(seconds), "seconds": seconds, "exact": exact, "batch": batch}


if __name__ == "__main__":
    sys.exit(main())
