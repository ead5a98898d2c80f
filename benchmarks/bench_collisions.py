"""Collision-search benchmark: SmolLM2 minimum distances per layer next to the paper's, and throughput.

Default run (under ~15 minutes on 2 CPU cores):

1. throughput at N = 20,000, d = 576: the exact search over 2×10⁸ pairs of 20,000 real SmolLM2 vectors (rows of
   its input embedding matrix, i.e. layer-0 states of single tokens), repeated; pairs/s and the fraction of this
   machine's float32 matmul FLOP/s (torch.mm of the tile shape, measured in the same run);
2. `find_collisions` on SmolLM2 at layers 1, 15, 30 (N prompts from the mixed corpus): minimum distances printed
   next to the paper's figures, pairs/s, matmul fraction, peak memory;
3. the exhaustive next-token test on the closest prompt of step 2 (|V| = 49,152 continuations, 1.2×10⁹ pairs
   per layer).

Timed sections hold ``flock /tmp/lminvert-bench.lock`` so that benchmarks sharing the machine do not overlap.

    python benchmarks/bench_collisions.py                       # the default run
    python benchmarks/bench_collisions.py --n-prompts 20000 --max-tokens 32 --prefixes 3   # bigger
    python benchmarks/bench_collisions.py --only throughput --tune                          # tile shapes
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import lminvert
from lminvert.collisions import exhaustive_test, find_collisions, pairwise_min
from lminvert.collisions.exhaustive import prefixes_from_collisions
from lminvert.collisions.search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS
from lminvert.collisions.throughput import matmul_flops
from lminvert.runs import peak_rss_mb

LOCK = "/tmp/lminvert-bench.lock"

# minimum last-token distance at layer 1 / L/2 / L (paper §4.1)
PAPER = {
    "Llama-3.1-8B": (0.001, 0.129, 0.620),
    "Mistral-7B": (0.002, 0.187, 1.274),
    "Phi-4-mini": (0.014, 1.336, 9.020),
    "TinyStories-33M": (0.029, 1.434, 2.793),
}


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    with open(LOCK, "w") as handle:
        start = time.perf_counter()
        fcntl.flock(handle, fcntl.LOCK_EX)
        waited = time.perf_counter() - start
        if waited > 1:
            print(f"(waited {waited:.0f} s for {LOCK})")
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def throughput(model, n: int, repeats: int, rows: int, cols: int) -> dict:
    weights = model.probe.vocab_matrix().float().numpy()
    rng = np.random.default_rng(0)
    x = np.ascontiguousarray(weights[np.sort(rng.choice(len(weights), size=n, replace=False))])
    d = x.shape[1]
    runs = []
    for _ in range(repeats):
        before = matmul_flops(rows, cols, d, reps=5)
        result = pairwise_min(x, k=10, tile_rows=rows, tile_cols=cols)
        after = matmul_flops(rows, cols, d, reps=5)
        s = result.stats
        mm = statistics.median(before + after)
        runs.append(
            {
                "seconds": s.seconds,
                "pairs_per_second": s.pairs_per_second,
                "achieved_gflops": s.pair_flops / s.seconds / 1e9,
                "matmul_gflops": mm / 1e9,
                "matmul_fraction": s.pair_flops / s.seconds / mm,
                "gemm_s": s.gemm_seconds,
                "reduce_s": s.reduce_seconds,
                "exact_s": s.exact_seconds,
                "prepare_s": s.prepare_seconds,
                "n_exact": s.n_exact,
                "min_distance": result.min_distance,
            }
        )
    best = max(runs, key=lambda r: r["matmul_fraction"])
    fractions = [r["matmul_fraction"] for r in runs]
    return {"n": n, "d": d, "n_pairs": n * (n - 1) // 2, "tile": [rows, cols], "runs": runs, "best": best,
            "median_fraction": statistics.median(fractions)}  # fmt: skip


def print_throughput(t: dict) -> None:
    print(f"\n## Throughput: N = {t['n']:,}, d = {t['d']}, {t['n_pairs']:,} pairs, tiles {t['tile'][0]}x{t['tile'][1]}")
    print(
        "| run | seconds | pairs/s | pair GFLOP/s | matmul GFLOP/s | fraction | gemm s | reduce s | exact s | prep s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(t["runs"], 1):
        print(
            f"| {i} | {r['seconds']:.2f} | {r['pairs_per_second']:.3g} | {r['achieved_gflops']:.1f} "
            f"| {r['matmul_gflops']:.1f} | {r['matmul_fraction']:.3f} | {r['gemm_s']:.2f} | {r['reduce_s']:.2f} "
            f"| {r['exact_s']:.2f} | {r['prepare_s']:.2f} |"
        )
    print(f"matmul fraction: median {t['median_fraction']:.3f}, best {t['best']['matmul_fraction']:.3f} (target 0.70)")


def collisions(model, args: argparse.Namespace, out: Path) -> dict:
    results = find_collisions(
        model,
        corpus=args.corpus,
        n_prompts=args.n_prompts,
        layers="1,middle,-1",
        max_tokens=args.max_tokens,
        out=out,
        seed=args.seed,
        progress=False,
    )
    doc = results.to_dict()
    print(
        f"\n## SmolLM2-135M: {results.n_prompts:,} prompts ({args.corpus}, {args.max_tokens} tokens, seed {args.seed}),"
        f" {results.n_pairs:,} pairs per layer"
    )
    print("| model | layer 1 | layer L/2 | layer L |")
    print("|---|---:|---:|---:|")
    mins = [results.layers[name].min_distance for name in ("1", "15", "30")]
    print(f"| SmolLM2-135M (here, exact) | {mins[0]:.3f} | {mins[1]:.3f} | {mins[2]:.3f} |")
    for name, row in PAPER.items():
        print(f"| {name} (paper) | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} |")
    noise = [results.layers[name].details["rounding_noise"]["max"] for name in ("1", "15", "30")]
    print(f"| rounding noise (re-encoded in another batch) | {noise[0]:.2g} | {noise[1]:.2g} | {noise[2]:.2g} |")
    median = [results.layers[name].nn_quantiles["0.5"] for name in ("1", "15", "30")]
    print(f"| median nearest-neighbour distance (here) | {median[0]:.3f} | {median[1]:.3f} | {median[2]:.3f} |")
    below = sum(r.n_below_threshold for r in results.layers.values())
    t = doc["timings"]
    print(
        f"collisions under 1e-6: {below}; search {results.pairs_per_second:.3g} pairs/s, matmul fraction "
        f"{results.matmul_fraction:.3f}; encoding {t['encoding_seconds']:.0f} s, search {t['search_seconds']:.1f} s; "
        f"peak memory {doc['memory_peak_mb']:.0f} MiB"
    )
    return doc


def _fmt(value: float | None) -> str:
    return "not tracked" if value is None else f"{value:.4g}"


def exhaustive(model, source: Path, count: int, out: Path) -> dict:
    prefixes = prefixes_from_collisions(source, count)
    results = exhaustive_test(model, prefixes, layers="1,middle,-1", out=out, progress=False)
    doc = results.to_dict()
    print(
        f"\n## Exhaustive: {len(prefixes)} prefix(es) x {results.vocab_size:,} continuations, "
        f"{results.n_pairs:,} pairs per prefix and layer"
    )
    print("| prefix | layer | min distance | pairs < 1e-6 | tied-token pairs (< 1e-6, max distance) "
          "| min, inputs differ | pairs < 1e-6, inputs differ | rounding noise |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in results.prefixes:
        for n, r in p.layers.items():
            tied, differ = r.details["tied_tokens"], r.details["inputs_differ"]
            tied_text = f"{tied['n_pairs']} ({tied['n_below_threshold']}, {tied['max_distance']:.2g})" if tied[
                "n_pairs"] else "0"  # fmt: skip
            print(
                f"| {p.text[-40:]!r} | {n} | {r.min_distance:.4g} | {r.n_below_threshold} | {tied_text} "
                f"| {_fmt(differ['min_distance'])} | {differ['n_below_threshold']} "
                f"| {r.details['rounding_noise']['max']:.2g} |"
            )
    t = doc["timings"]
    print(
        f"collisions under 1e-6: {sum(r['n_below_threshold'] for r in results.layers.values())} "
        f"({sum(r['n_below_threshold_inputs_differ'] for r in results.layers.values())} with differing inputs); "
        f"{results.pairs_per_second:.3g} pairs/s, matmul fraction {results.matmul_fraction:.3f}; "
        f"encoding {t['encoding_seconds']:.0f} s, search {t['search_seconds']:.0f} s; "
        f"peak memory {doc['memory_peak_mb']:.0f} MiB"
    )
    return doc


def tune(model, n: int) -> None:
    print("\n## Tile shapes (one run each)")
    print("| rows | cols | fraction | pairs/s |")
    print("|---:|---:|---:|---:|")
    for rows, cols in [(512, 4096), (768, 6144), (1024, 4096), (1024, 8192), (1536, 6144), (2048, 4096)]:
        t = throughput(model, n, 1, rows, cols)
        r = t["best"]
        print(f"| {rows} | {cols} | {r['matmul_fraction']:.3f} | {r['pairs_per_second']:.3g} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["throughput", "collisions", "exhaustive"], help="run one part")
    parser.add_argument("--n", type=int, default=20_000, help="vectors in the throughput test")
    parser.add_argument("--repeats", type=int, default=3, help="throughput repetitions")
    parser.add_argument("--tile-rows", type=int, default=DEFAULT_TILE_ROWS)
    parser.add_argument("--tile-cols", type=int, default=DEFAULT_TILE_COLS)
    parser.add_argument("--tune", action="store_true", help="also compare tile shapes")
    parser.add_argument("--n-prompts", type=int, default=3000, help="prompts in the SmolLM2 collision search")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--corpus", default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefixes", type=int, default=1, help="prefixes in the exhaustive test (0: skip)")
    parser.add_argument("--out", default="runs/bench-collisions", help="work directory (emptied first)")
    args = parser.parse_args()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = lminvert.load_model("smollm2-135m")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    report: dict = {"args": vars(args)}
    start = time.perf_counter()
    with bench_lock():
        if args.only in (None, "throughput"):
            report["throughput"] = throughput(model, args.n, args.repeats, args.tile_rows, args.tile_cols)
            print_throughput(report["throughput"])
            if args.tune:
                tune(model, args.n)
        if args.only in (None, "collisions", "exhaustive"):
            report["collisions"] = collisions(model, args, out / "collisions")
        if args.only in (None, "exhaustive") and args.prefixes > 0:
            report["exhaustive"] = exhaustive(model, out / "collisions", args.prefixes, out / "exhaustive")
    report["seconds"] = time.perf_counter() - start
    report["peak_memory_mb"] = peak_rss_mb()
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(
        f"\ntotal {report['seconds']:.0f} s, peak memory {report['peak_memory_mb']:.0f} MiB; wrote {out / 'bench.json'}"
    )


if __name__ == "__main__":
    main()
