"""Inversion benchmark: exactness, speed, explored vocabulary and the sequential baseline, side by side.

    python benchmarks/bench_invert.py                       # SmolLM2, layers 1,15,30 (the issue's setting)
    python benchmarks/bench_invert.py --layers 15 --per-kind 1 --baseline-seconds 120
    python benchmarks/bench_invert.py --model gpt2-small-random --layers 1,6,12 --bruteforce 0 --baseline 0

Prints one table per layer and writes everything to --out (JSON). Figures are measured here, not asserted.
Columns: exact prompts; median and mean seconds per prompt; max/med: the slowest prompt over the median; med c/p and
mean c/p: candidates verified per position; explored: mean share of the vocabulary; wrong: positions recovered
wrong without an uncertain flag (must be 0); med fwd: median forwards per prompt (verification, confirmation, prefix
extension: on a GPU the sequential rounds that set the time); spec: share of positions decided from a chain of first
guesses (speculative verification); % r/v/e/o: time in ranking / verification / prefix extension / other.
A policy ``linear-`` is ``linear`` without speculation, ``linear@16`` with candidate batches 16x a CPU's,
``linear.f32`` without screening (every candidate verified in float32; the default screens a float32 model's large
batches with bfloat16 GEMMs on a CPU that has native ones, :mod:`lminvert.invert.engine`).

    python benchmarks/bench_invert.py --layers 0,3,6,9,12,15,18,21,24,27,30 --bruteforce 0 --baseline 0   # depth
    python benchmarks/bench_invert.py --layers 15 --long 500 --bruteforce 0 --baseline 0   # cost against length
    python benchmarks/bench_invert.py --layers 1,15 --dtypes float32,bfloat16,float16 --policies linear \
        --bruteforce 0 --baseline 0      # precision: the same prompts in each dtype, ratio against float32
    python benchmarks/bench_invert.py --layers 15 --together 7 --policies linear --bruteforce 0 --baseline 0
                                         # N prompts inverted together against one at a time (throughput)
Timed sections hold /tmp/lminvert-bench.lock so that two benchmarks never share the cores.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.baseline import sequential_baseline
from lminvert.invert.reader import load_reader, reading_for
from lminvert.invert.tables import first_position_table, second_position_map
from lminvert.invert.tolerance import calibrate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="1,15,30")
    ap.add_argument("--per-kind", type=int, default=2, help="prompts per kind (prose, code, random) + 1 personal")
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument(
        "--policies", default="linear,gradient", help="comma-separated; NAME@K: candidate batches K times a CPU's"
    )
    ap.add_argument("--bruteforce", type=int, default=1, help="prompts per layer checked by the brute-force oracle")
    ap.add_argument("--bruteforce-positions", type=int, default=4, help="positions of those prompts (cost: |V| each)")
    ap.add_argument("--baseline", type=int, default=1, help="prompts for the sequential baseline (at the middle layer)")
    ap.add_argument("--baseline-seconds", type=float, default=300.0, help="time limit per baseline prompt")
    ap.add_argument(
        "--baseline-skip-first",
        action="store_true",
        help="give the baseline the true first token: time ordinary positions, not the attention sink",
    )
    ap.add_argument("--long", type=int, default=0, help="also time one prose prompt of this many tokens (e.g. 500)")
    ap.add_argument("--dtypes", default="float32", help="comma-separated; each is compared with the first")
    ap.add_argument("--device", default="cpu", help="cpu, auto, cuda, cuda:N or mps")
    ap.add_argument("--together", type=int, default=0, help="also invert this many prompts together vs one at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench/invert.json")
    args = ap.parse_args()

    lock = open(os.environ.get("LMINVERT_BENCH_LOCK", "/tmp/lminvert-bench.lock"), "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    dtypes = args.dtypes.split(",")
    models = {dtype: lminvert.load_model(args.model, dtype=dtype, device=args.device) for dtype in dtypes}
    model = models[dtypes[0]]
    prompts = evaluation_prompts(model, args.per_kind, args.length, args.seed)
    layers = model.probe.layers(args.layers)
    report: dict = {
        "model": model.describe(),
        "dtypes": dtypes,
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "prompts": [{"kind": p.kind, "ids": list(p.ids)} for p in prompts],
        "layers": {},
    }
    missing = [layer.name for layer in layers if int(layer) > 0 and load_reader(model, layer) is None]
    if missing:  # the figures of docs/results.md's headline were measured with networks at every 3rd layer
        print(
            f"no reading network cached at layer(s) {', '.join(missing)}: those layers read positions with the linear "
            f"map (a fresh machine's figures: random-id prompts are slower); `lminvert models --prepare {args.model} "
            f"--reader {','.join(missing)}` trains them, minutes per layer (SmolLM2's every 3rd layer from 3: `make "
            f"readers`, 28.5 min on a 2-core AVX512-BF16 CPU)"
        )
    print(
        f"{args.model}: {len(prompts)} prompts of {args.length} tokens "
        f"({', '.join(sorted({p.kind for p in prompts}))}), threads={torch.get_num_threads()}"
    )
    for layer in layers:
        entry: dict = {"precompute_seconds": {}, "calibration": {}, "policies": {}, "dtypes": {}}
        print(f"\nlayer {layer}")
        for dtype, m in models.items():  # once per model, dtype and layer, then cached: not in the times below
            t0 = time.perf_counter()
            first_position_table(m, layer, progress=False)
            second_position_map(m, layer)
            calibration = calibrate(m, layer)
            reading_for(m, layer)  # the reading network where one is cached, else the linear map (built here)
            entry["precompute_seconds"][dtype] = time.perf_counter() - t0
            entry["calibration"][dtype] = calibration.as_dict()
            reads = "reading network" if load_reader(m, layer) is not None else "linear reading map"
            entry.setdefault("reading", {})[dtype] = reads
            print(
                f"  {dtype}: tables, reading, calibration {entry['precompute_seconds'][dtype]:.1f} s (cached); "
                f"measured disagreement {calibration.cached:.1e} (cached forward), {calibration.plain:.1e} (plain); "
                f"smallest gap {calibration.gap:.1e} (relative); states read by the {reads}"
            )
        if len(models) > 1:
            entry["verification_ms"] = _verification_cost(models, layer, list(prompts[0].ids))
        print(
            f"  {'method':<18} {'exact':>7} {'median s':>9} {'mean s':>8} {'max/med':>7} {'med c/p':>8} "
            f"{'mean c/p':>9} {'explored':>9} {'wrong':>5} {'unc':>4} {'conf/p':>6} {'med fwd':>7} {'spec':>5} "
            f"{'% r/v/e/o':>12}  by kind"
        )
        encoded = {dtype: encode(m, [list(p.ids) for p in prompts], layer) for dtype, m in models.items()}
        for policy in args.policies.split(","):
            per_dtype: dict[str, list] = {dtype: [] for dtype in models}
            for i in range(len(prompts)):  # each prompt in every dtype back to back: load changes hit all alike
                for dtype, m in models.items():
                    one = encoded[dtype].with_meta(states=encoded[dtype].states[i : i + 1])
                    per_dtype[dtype] += invert(m, one, method="sipit", seed=args.seed, **_policy(policy))
            for dtype in models:
                results = per_dtype[dtype]
                rows = _summarise(results, prompts)
                entry["dtypes"].setdefault(dtype, {})[policy] = rows
                if dtype == dtypes[0]:
                    entry["policies"][policy] = rows
                _print_row(f"{policy}/{dtype}"[:18], rows)
            if len(models) > 1:
                for dtype in dtypes[1:]:
                    ratios = [
                        r.seconds / f.seconds for r, f in zip(per_dtype[dtype], per_dtype[dtypes[0]], strict=True)
                    ]
                    entry["dtypes"][dtype][policy]["per_prompt_ratio_median"] = statistics.median(ratios)
                    print(f"  {policy}: per prompt {dtype} / {dtypes[0]}: median {statistics.median(ratios):.2f}x")
            base = entry["dtypes"][dtypes[0]][policy]["median_seconds"]
            for dtype in dtypes[1:]:
                ratio = entry["dtypes"][dtype][policy]["median_seconds"] / base
                entry["dtypes"][dtype][policy]["median_over_first"] = ratio
                print(f"  {policy}: median {dtype} / {dtypes[0]} = {ratio:.2f}x")
        if args.together:
            entry["together"] = _together(model, layer, args)
        if args.bruteforce:
            n, k = args.bruteforce, args.bruteforce_positions
            states = encoded[dtypes[0]]
            sub = states.with_meta(states=tuple(s[:k] for s in states.states[:n]))
            results = invert(model, sub, method="bruteforce")
            truth = [p.ids[:k] for p in prompts[:n]]
            exact = sum(tuple(r.token_ids) == t for r, t in zip(results, truth, strict=True))
            secs = [r.seconds / k for r in results]
            entry["bruteforce"] = {
                "prompts": n,
                "positions": k,
                "exact": exact,
                "seconds_per_position": statistics.median(secs),
            }
            print(
                f"  {'bruteforce':<18} {exact}/{n} prompts exact on their first {k} positions; "
                f"{statistics.median(secs):.1f} s per position (|V| verified each)"
            )
        report["layers"][str(layer)] = entry
    if args.baseline:
        layer = layers[len(layers) // 2]
        print(
            f"\nsequential baseline at layer {layer} (one candidate per gradient step, full uncached forwards), "
            f"time limit {args.baseline_seconds:.0f} s per prompt:"
        )
        base_rows = []
        for p in prompts[: args.baseline]:
            states = encode(model, [list(p.ids)], layer).states[0]
            known = list(p.ids[:1]) if args.baseline_skip_first else None
            b = sequential_baseline(model, states, layer, time_limit=args.baseline_seconds, known=known)
            truth = p.ids[1:] if known else p.ids
            ok = sum(int(a == t) for a, t in zip(b.token_ids, truth, strict=False))
            per_tok = b.seconds / max(1, len(b.token_ids))
            base_rows.append(
                {
                    "kind": p.kind,
                    "tokens_recovered": len(b.token_ids),
                    "correct": ok,
                    "seconds": b.seconds,
                    "seconds_per_token": per_tok,
                    "candidates": b.candidates_checked,
                    "complete": b.complete,
                }
            )
            print(
                f"  {p.kind:<9} {len(b.token_ids):>2}/{len(p.ids)} tokens ({ok} right) in {b.seconds:.0f} s: "
                f"{per_tok:.1f} s/token, candidates {b.candidates_checked}"
            )
        ours = report["layers"][str(layer)]["policies"][args.policies.split(",")[0]]
        ours_per_tok = ours["median_seconds"] / args.length  # all positions, the first one included
        base_per_tok = statistics.median(r["seconds_per_token"] for r in base_rows)
        ratio = base_per_tok / ours_per_tok
        report["baseline"] = {
            "layer": layer,
            "rows": base_rows,
            "seconds_per_token": base_per_tok,
            "ours_seconds_per_token": ours_per_tok,
            "speedup": ratio,
        }
        print(
            f"  baseline {base_per_tok:.2f} s/token vs lminvert {ours_per_tok:.3f} s/token: {ratio:.0f}x faster "
            "(a lower bound where the baseline hit its time limit on slow early positions)"
        )
    if args.long:
        report["long"] = _long_prompt(model, layers[len(layers) // 2], args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _long_prompt(model, layer, args) -> dict:
    """Cost against length: one prose prompt of ``args.long`` tokens against its first ``args.length`` tokens, and
    against the same tokens cut into windows of ``args.length`` inverted one by one (the same text, so the ratio to
    their sum measures what length itself costs, apart from how predictable the rest of the text is)."""
    (long,) = [p for p in evaluation_prompts(model, 1, args.long, args.seed + 1) if p.kind == "prose"]
    policy = _policy(args.policies.split(",")[0])

    def run(ids: list[int]) -> dict:
        (r,) = invert(model, encode(model, [ids], layer), seed=args.seed, **policy)
        return {"exact": r.token_ids == ids, "seconds": r.seconds, "time_split": r.time_split,
                "mean_candidates": sum(r.candidates_checked) / len(ids)}  # fmt: skip

    rows = {n: run(list(long.ids[:n])) for n in (args.length, args.long)}
    ids = list(long.ids[: args.long])
    windows = [run(ids[i : i + args.length]) for i in range(0, len(ids) - args.length + 1, args.length)]
    pieces = sum(w["seconds"] for w in windows)
    ratio = rows[args.long]["seconds"] / rows[args.length]["seconds"]
    print(
        f"\nlength at layer {layer}: {args.length} tokens {rows[args.length]['seconds']:.2f} s, {args.long} tokens "
        f"{rows[args.long]['seconds']:.2f} s ({ratio:.1f}x for {args.long / args.length:.0f}x the tokens; exact: "
        f"{rows[args.length]['exact']}, {rows[args.long]['exact']}; "
        f"{rows[args.long]['mean_candidates']:.1f} candidates per position)\n"
        f"  the same {len(windows) * args.length} tokens as {len(windows)} prompts of {args.length}: {pieces:.2f} s in "
        f"all (median {statistics.median(w['seconds'] for w in windows):.2f} s, all exact: "
        f"{all(w['exact'] for w in windows)}); the long prompt takes {rows[args.long]['seconds'] / pieces:.2f}x that"
    )
    return {"layer": int(layer), "rows": rows, "ratio": ratio, "windows": windows, "windows_seconds": pieces,
            "ratio_to_windows": rows[args.long]["seconds"] / pieces}  # fmt: skip


def _verification_cost(models, layer, ids, batch=64, reps=5) -> dict:
    """Milliseconds of one verification forward (``batch`` candidates over a 19-token prefix) per dtype: the
    median of ``reps`` calls, the dtypes interleaved so that a change in the machine's load hits all of them."""
    prefixes = {dtype: m.probe.prefix(ids[:19], layer) for dtype, m in models.items()}
    cands = torch.arange(batch) + 1000
    times: dict[str, list[float]] = {dtype: [] for dtype in models}
    for _ in range(reps + 1):  # the first round warms up
        for dtype, m in models.items():
            start = time.perf_counter()
            m.probe.continuation(prefixes[dtype], token_ids=cands)
            times[dtype].append(1000 * (time.perf_counter() - start))
    out = {dtype: statistics.median(t[1:]) for dtype, t in times.items()}
    first = next(iter(out))
    print(
        f"  one verification forward of {batch} candidates: "
        + ", ".join(f"{d} {ms:.0f} ms ({ms / out[first]:.2f}x)" for d, ms in out.items())
    )
    return out


def _policy(spec: str) -> dict:
    """``linear``, ``linear@16`` (candidate batches 16x a CPU's, whatever the device), ``linear-`` (no speculative
    verification) or ``linear.f32`` (no screening), combined in that order, as invert() arguments."""
    name, _, scale = spec.partition("@")
    name, dot, unscreened = name.partition(".")
    if dot and unscreened != "f32":
        raise SystemExit(f"unknown policy suffix .{unscreened} in {spec}: .f32 (no screening) is the only one")
    return {
        "policy": name.rstrip("-"),
        "batch_scale": int(scale) if scale else None,
        "speculate": name[-1:] != "-",
        "screen": False if dot else None,
    }


def _together(model, layer, args) -> dict:
    """N prompts inverted together (one verification forward per step across prompts) against one at a time."""
    n = args.together
    pool = evaluation_prompts(model, max(1, -(-(n - 1) // 3)), args.length, args.seed)[:n]
    states = encode(model, [list(p.ids) for p in pool], layer)
    policy = args.policies.split(",")[0]
    timed = {}
    for label, together in (("one at a time", 1), (f"{n} together", n)):
        start = time.perf_counter()
        results = invert(model, states, seed=args.seed, together=together, **_policy(policy))
        seconds = time.perf_counter() - start
        timed[label] = (seconds, results)
    (one_s, one), (all_s, many) = timed.values()
    same_ids = [a.token_ids for a in one] == [b.token_ids for b in many]
    same_flags = [a.uncertain_positions for a in one] == [b.uncertain_positions for b in many]
    same_checked = [a.candidates_checked for a in one] == [b.candidates_checked for b in many]
    exact = sum(r.token_ids == list(p.ids) for r, p in zip(many, pool, strict=True))
    tokens = sum(len(p.ids) for p in pool)
    print(
        f"  together: {n} prompts ({tokens} tokens) one at a time {one_s:.1f} s ({tokens / one_s:.1f} tok/s), "
        f"together {all_s:.1f} s ({tokens / all_s:.1f} tok/s): {one_s / all_s:.2f}x the throughput; "
        f"{exact}/{n} exact; same ids {same_ids}, same flags {same_flags}, same candidates {same_checked}"
    )
    return {
        "prompts": n,
        "tokens": tokens,
        "one_at_a_time_seconds": one_s,
        "together_seconds": all_s,
        "throughput_ratio": one_s / all_s,
        "exact": exact,
        "same_ids": same_ids,
        "same_uncertain": same_flags,
        "same_candidates": same_checked,
    }


def _summarise(results, prompts) -> dict:
    exact = [tuple(r.token_ids) == p.ids for r, p in zip(results, prompts, strict=True)]
    secs = [r.seconds for r in results]
    cands = [c for r in results for c in r.candidates_checked]
    wrong_confident = sum(
        1
        for r, p in zip(results, prompts, strict=True)
        for t, (got, pos) in enumerate(zip(r.token_ids, r.positions, strict=True))
        if got != p.ids[t] and not pos.uncertain
    )
    split = {k: sum(r.time_split[k] for r in results) for k in ("ranking", "verification", "extension")}
    total = sum(secs)
    by_kind: dict[str, list] = {}
    for r, p, ok in zip(results, prompts, exact, strict=True):
        by_kind.setdefault(p.kind, []).append((ok, r.seconds, sum(r.candidates_checked) / len(r.candidates_checked)))
    vocab = results[0].vocab_size
    return {
        "exact_rate": sum(exact) / len(exact),
        "median_seconds": statistics.median(secs),
        "mean_seconds": statistics.mean(secs),
        "mean_candidates_per_position": statistics.mean(cands),
        "median_candidates_per_position": statistics.median(cands),
        "max_over_median_seconds": max(secs) / statistics.median(secs),
        "wrong_but_confident_positions": wrong_confident,
        "time_split": {k: v / total for k, v in split.items()} | {"other": 1 - sum(split.values()) / total},
        "explored_fraction": statistics.mean(cands) / vocab,
        "uncertain_positions": sum(len(r.uncertain_positions) for r in results),
        "confirmed_per_position": statistics.mean(p.confirmed for r in results for p in r.positions),
        "median_forwards": statistics.median(r.forwards for r in results),
        "forwards": [r.forwards for r in results],
        "speculated_fraction": statistics.mean(p.speculated for r in results for p in r.positions),
        "by_kind": {
            k: {
                "exact": sum(o for o, _, _ in v),
                "n": len(v),
                "median_seconds": statistics.median(s for _, s, _ in v),
                "mean_candidates": statistics.mean(c for _, _, c in v),
            }
            for k, v in by_kind.items()
        },
        "seconds": secs,
    }


def _print_row(name: str, rows: dict) -> None:
    kinds = "  ".join(
        f"{k} {v['exact']}/{v['n']} {v['median_seconds']:.1f}s {v['mean_candidates']:.0f}c"
        for k, v in rows["by_kind"].items()
    )
    split = "/".join(f"{100 * rows['time_split'][k]:.0f}" for k in ("ranking", "verification", "extension", "other"))
    print(
        f"  {name:<18} {100 * rows['exact_rate']:>6.0f}% {rows['median_seconds']:>9.2f} {rows['mean_seconds']:>8.2f} "
        f"{rows['max_over_median_seconds']:>6.1f}x {rows['median_candidates_per_position']:>8.0f} "
        f"{rows['mean_candidates_per_position']:>9.1f} {100 * rows['explored_fraction']:>8.3f}% "
        f"{rows['wrong_but_confident_positions']:>5} {rows['uncertain_positions']:>4} "
        f"{rows['confirmed_per_position']:>6.2f} {rows['median_forwards']:>7.0f} "
        f"{100 * rows['speculated_fraction']:>4.0f}% {split:>12}  {kinds}"
    )


if __name__ == "__main__":
    sys.exit(main())
