"""Ray benchmark: per-task times, scaling from 1 to W local workers, Ray's overhead against in-process, and a
projection of the paper's collision runs onto N machines.

Two jobs, each run in this process (one thread, like one worker) and on a local Ray with 1 and 2 workers:

1. split search: the exact pairwise search of one layer of N real SmolLM2 vectors (rows of its input embedding
   matrix, shuffled), d = 576, split into B row blocks of about ``--block-pairs`` pairs (one
   :class:`BlockTask` each), then merged by the layer task; checked against the same layer searched as one task;
2. encoding: SmolLM2 last-token states of P prompts at every layer, in store chunks (the model loaded once per
   worker), written into a :class:`StateStore` by the driver as they arrive.

For each: wall time, per-task time, tasks per worker, idle time per worker, the merge time and the bytes shipped
(pickled tasks and results, and for the search the block files the merge reads), then the speed-up 1 -> 2
workers and the per-task overhead of Ray. Finally the measured per-block pair rate, parallel efficiency, task
overhead and merge cost project the paper's 5×10⁹-pair collision run and a 3.4×10¹¹-pair exhaustive run onto N
machines of C cores.

    OMP_NUM_THREADS=1 python benchmarks/bench_ray.py                 # ~3 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/bench_ray.py --n 40000 --block-pairs 1e8 --prompts 384
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import lminvert
from lminvert.collisions.fill import _Prompts
from lminvert.collisions.runner import SearchSettings
from lminvert.collisions.search import BlockSearch, block_pairs, merge_blocks, row_blocks
from lminvert.collisions.store import StateStore
from lminvert.collisions.tasks import LayerTask, block_tasks, run_block_task, run_layer_task
from lminvert.corpora import sample_prompts
from lminvert.executors import Executor, InProcessExecutor, ModelSetup, Plain, TaskRecord

# name: (vectors per layer search, layer searches): 10^5 prompts at one layer; 283 prefix-layer searches of a
# 49,152-token vocabulary (1.2×10⁹ pairs each)
PAPER_RUNS = {
    "collisions (paper §4.1, ~5×10⁹ pairs)": (100_000, 1),
    "exhaustive (3.4×10¹¹ pairs)": (49_152, 283),
}


def layer_task(model: lminvert.LoadedModel, n: int, directory: Path) -> LayerTask:
    """One layer search of ``n`` shuffled embedding rows of the model (distinct real vectors)."""
    rows = model.probe.embedding.weight.detach().float().numpy()
    path = directory / "x.npy"
    np.save(path, rows[np.random.default_rng(0).choice(len(rows), size=n, replace=False)])
    return LayerTask(str(path), 0, str(directory / "layer.json"), str(directory / "nn.npy"), progress=False)


def clear(task: LayerTask) -> None:
    Path(task.out_json).unlink(missing_ok=True)
    Path(task.out_nn).unlink(missing_ok=True)
    shutil.rmtree(task.blocks_dir, ignore_errors=True)


def split_search(runner: Executor, split: LayerTask) -> dict[str, Any]:
    """The blocks on ``runner``, then the merge: read the blocks back and merge them (timed alone), and the layer
    task (merge, NN summary and the layer's files) in this process."""
    clear(split)
    blocks = block_tasks([split])
    m = timed(runner, None, Plain(run_block_task), blocks, lambda i, r: None)
    m["bytes"] += sum(b.path.stat().st_size for b in blocks)  # what the merge reads from the shared disk
    began = time.perf_counter()
    merge_blocks([BlockSearch.load(b.path) for b in blocks])
    m["merge"] = time.perf_counter() - began
    began = time.perf_counter()
    m["summary"] = run_layer_task(split)
    m["finish"] = time.perf_counter() - began
    return m


def profile(records: Sequence[TaskRecord], wall: float) -> dict[str, Any]:
    """Per worker: tasks, busy seconds, idle seconds within the map's wall time."""
    by_worker: dict[str, list[TaskRecord]] = defaultdict(list)
    for r in records:
        by_worker[r.worker].append(r)
    busy = {w: sum(r.seconds for r in rs) for w, rs in by_worker.items()}
    return {
        "tasks_per_worker": sorted(len(rs) for rs in by_worker.values()),
        "busy": sorted(busy.values()),
        "idle": sorted(wall - b for b in busy.values()),
        "task_median": statistics.median(r.seconds for r in records),
        "task_max": max(r.seconds for r in records),
    }


def timed(
    runner: Executor, setup: Any, fn: Callable[[Any, Any], Any], tasks: Sequence[Any], merge: Callable[[int, Any], None]
) -> dict[str, Any]:
    """Run ``tasks`` on ``runner``, merging each result as it arrives; wall, merge time, bytes, profile."""
    runner.records.clear()
    start = time.perf_counter()
    merging = 0.0
    shipped = sum(len(pickle.dumps(t)) for t in tasks)
    for index, result in runner.map_with(setup, fn, tasks):
        began = time.perf_counter()
        merge(index, result)
        merging += time.perf_counter() - began
        shipped += len(pickle.dumps(result))
    wall = time.perf_counter() - start
    return {
        "wall": wall,
        "merge": merging,
        "bytes": shipped,
        "records": list(runner.records),
        **profile(runner.records, wall),
    }


def show(label: str, m: dict[str, Any], n_tasks: int) -> None:
    print(
        f"  {label:<14} wall {m['wall']:6.2f} s | task median {m['task_median']:.3f} s, max {m['task_max']:.3f} s | "
        f"tasks/worker {m['tasks_per_worker']} | idle/worker {[round(x, 2) for x in m['idle']]} s | "
        f"merge {1e3 * m['merge']:.1f} ms | shipped {m['bytes'] / 1e6:.2f} MB "
        f"({m['bytes'] / n_tasks / 1e3:.1f} kB/task)"
    )


def compare(name: str, runs: dict[str, dict[str, Any]], n_tasks: int) -> None:
    here, one, two = runs["in-process"], runs["ray, 1 worker"], runs["ray, 2 workers"]
    print(
        f"  => {name}: speed-up 1 -> 2 workers {one['wall'] / two['wall']:.2f}x "
        f"(ideal 2.00x; efficiency {one['wall'] / two['wall'] / 2:.0%}); Ray 1 worker vs in-process: "
        f"{one['wall'] / here['wall']:.2f}x wall, {(one['wall'] - here['wall']) / n_tasks * 1e3:+.0f} ms per task"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32_000, help="vectors in the layer that is split")
    parser.add_argument("--block-pairs", type=float, default=6.4e7, help="pairs per row block")
    parser.add_argument("--prompts", type=int, default=192, help="prompts encoded")
    parser.add_argument("--chunk", type=int, default=24, help="prompts per encoding task")
    parser.add_argument("--machines", default="1,2,4,8,16,64", help="N for the projection")
    parser.add_argument("--cores", type=int, default=32, help="cores per machine for the projection")
    args = parser.parse_args()

    import ray

    from lminvert.ray_executor import RayExecutor

    torch.set_num_threads(1)  # in-process = one worker's share of the machine
    model = lminvert.load_model("smollm2-135m")
    began = time.perf_counter()
    lminvert.load_model("smollm2-135m")
    load_seconds = time.perf_counter() - began
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        whole = layer_task(model, args.n, work)
        blocks = row_blocks(args.n, whole.tile_rows, whole.tile_cols, int(args.block_pairs))
        split = replace(whole, blocks=tuple(blocks))
        pairs = args.n * (args.n - 1) // 2
        prompts, _ = sample_prompts(model.tokenizer, "mixed", args.prompts, 16, 0)
        ids = [p.ids for p in prompts]
        layers = tuple(model.probe.layers("all"))
        chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
        encode = _Prompts(layers, 4096)
        print(f"machine: {torch.get_num_threads()} torch thread per worker; ray {ray.__version__}; model load "
              f"{load_seconds:.2f} s")  # fmt: skip
        sizes = [block_pairs(args.n, b) for b in blocks]
        print(f"\n[split search] one layer, N={args.n}, d={model.probe.hidden_size}: {pairs:.3g} pairs in "
              f"{len(blocks)} row blocks of {min(sizes):.3g} to {max(sizes):.3g} pairs")  # fmt: skip
        began = time.perf_counter()
        reference = run_layer_task(whole)
        one_task = time.perf_counter() - began
        print(f"  {'one task':<14} wall {one_task:6.2f} s (in-process, no split: the layer task of the default path)")
        search_runs: dict[str, dict[str, Any]] = {}
        encode_runs: dict[str, dict[str, Any]] = {}
        runners: list[tuple[str, Callable[[], Executor]]] = [
            ("in-process", InProcessExecutor),
            ("ray, 1 worker", lambda: RayExecutor(workers=1)),
            ("ray, 2 workers", lambda: RayExecutor(workers=2)),
        ]
        for label, make in runners:
            runner = make()
            if label != "in-process":  # start the workers outside the timing (a cluster keeps them)
                runner.map(len, [[0]] * runner.workers)
            search_runs[label] = split_search(runner, split)
            store = StateStore(work / f"store-{label[:6]}-{label[-9:]}", len(ids), model.probe.hidden_size,
                               [int(x) for x in layers], args.chunk)  # fmt: skip
            encode_runs[label] = timed(
                runner, ModelSetup.of(model), encode, chunks, lambda i, rows, s=store: s.write_chunk(i, rows)
            )
            getattr(runner, "close", lambda: None)()
            del runner
        for label, m in search_runs.items():
            show(label, m, len(blocks))
            print(f"  {'':<14} merge alone {1e3 * m['merge']:.0f} ms; layer task after the blocks (merge, NN "
                  f"summary, files) {m['finish']:.2f} s")  # fmt: skip
        same = all(_same_summary(m["summary"], reference) for m in search_runs.values())
        print(f"  merged = one task (minimum, pairs, counts, NN quantiles and histogram): {same}")
        compare("split search", search_runs, len(blocks))
        here = search_runs["in-process"]
        rate = statistics.median(
            block_pairs(args.n, b) / r.seconds for b, r in zip(blocks, sorted(here["records"], key=_index), strict=True)
        )
        rate_w = pairs / search_runs["ray, 2 workers"]["wall"] / 2
        print(f"  per core: {rate:.3g} pairs/s per block in-process (one task, no split: {pairs / one_task:.3g}); "
              f"{rate_w:.3g} pairs/s per worker with 2 workers")  # fmt: skip

        print(f"\n[encoding] {len(ids)} prompts x {len(layers)} layers in {len(chunks)} chunks of {args.chunk} "
              "(first task on each worker includes its model load)")  # fmt: skip
        for label, m in encode_runs.items():
            show(label, m, len(chunks))
        compare("encoding", encode_runs, len(chunks))

        one, two = search_runs["ray, 1 worker"], search_runs["ray, 2 workers"]
        efficiency = one["wall"] / two["wall"] / 2
        overhead = max(0.0, (one["wall"] - here["wall"]) / len(blocks))
        merge_per = here["merge"] / (len(blocks) * args.n)  # per block and vector: the NN minima dominate
        finish_per = (here["finish"] - here["merge"]) / args.n  # NN summary and spot check: linear in N
        machines = [int(x) for x in args.machines.split(",")]
        print(
            f"\n[projection] per-block rate {rate:.3g} pairs/s per core at d=576 (x576/d), parallel efficiency "
            f"{efficiency:.0%} (measured 1 -> 2 workers), {overhead * 1e3:.0f} ms overhead per task, merge "
            f"{merge_per * 1e9:.1f} ns per block and vector, layer task after its blocks {finish_per * 1e6:.1f} µs "
            f"per vector (x d/576; its fixed part scaled too: an upper bound); blocks as --ray makes them (up to "
            f"2e8 pairs, two per worker at least); {args.cores} cores per machine"
        )
        for name, (n, searches) in PAPER_RUNS.items():
            layer_pairs = n * (n - 1) // 2
            print(f"  {name}: {searches} layer search(es) of N={n}, {layer_pairs * searches:.3g} pairs")
            for d in (576, 4096):
                cells = []
                for count in machines:
                    workers = count * args.cores
                    per_block = SearchSettings().pairs_per_block(_Cluster(workers), n, searches)  # the --ray default
                    n_blocks = len(row_blocks(n, whole.tile_rows, whole.tile_cols, per_block))
                    rounds = -(-n_blocks * searches // workers)  # blocks run in rounds of one per worker
                    block_seconds = layer_pairs / n_blocks / (rate * 576 / d) / efficiency
                    finish = (merge_per * n_blocks * n + finish_per * n * d / 576) * -(-searches // workers)
                    seconds = rounds * (block_seconds + overhead) + finish
                    cells.append(f"{count}: {_duration(seconds)} ({n_blocks * searches} tasks)")
                print(f"    d={d}, machines: " + "; ".join(cells))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


class _Cluster:
    """What the block-size default looks at: a Ray executor with ``workers`` workers."""

    name = "ray"

    def __init__(self, workers: int) -> None:
        self.workers, self.records = workers, []


def _index(record: TaskRecord) -> int:
    return record.index


def _same_summary(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("min_distance", "closest", "n_below_threshold", "below_threshold", "nn_quantiles", "nn_histogram",
            "nn_exact_count", "nn_error_bound", "nn_spot_check")  # fmt: skip
    return all(a[k] == b[k] for k in keys)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


if __name__ == "__main__":
    main()
