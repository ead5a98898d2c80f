"""Ray benchmark: per-task times, scaling from 1 to W local workers, Ray's overhead against in-process, and a
projection of the paper's collision runs onto N machines.

Two jobs, each run in this process (one thread, like one worker) and on a local Ray with 1 and 2 workers:

1. search: T exact pairwise searches (one :class:`LayerTask` each) of N real SmolLM2 vectors (rows of its input
   embedding matrix, shuffled per task), d = 576;
2. encoding: SmolLM2 last-token states of P prompts at every layer, in store chunks (the model loaded once per
   worker), written into a :class:`StateStore` by the driver as they arrive.

For each: wall time, per-task time, tasks per worker, idle time per worker, the driver's merge time and the bytes
shipped (pickled tasks and results), then the speed-up 1 -> 2 workers and the per-task overhead of Ray. Finally
the measured per-core pair rate projects the paper's 5×10⁹-pair collision run and a 3.4×10¹¹-pair exhaustive run
onto N machines of C cores.

    OMP_NUM_THREADS=1 python benchmarks/bench_ray.py                 # ~3 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/bench_ray.py --n 24000 --tasks 8 --prompts 384
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

import lminvert
from lminvert.collisions.fill import _Prompts
from lminvert.collisions.store import StateStore
from lminvert.collisions.tasks import LayerTask, run_layer_task
from lminvert.corpora import sample_prompts
from lminvert.executors import Executor, InProcessExecutor, ModelSetup, Plain, TaskRecord

PAPER_RUNS = {"collisions (paper §4.1, ~5×10⁹ pairs)": 5e9, "exhaustive (3.4×10¹¹ pairs)": 3.4e11}


def search_tasks(model: lminvert.LoadedModel, n: int, count: int, directory: Path) -> list[LayerTask]:
    """``count`` tasks, each ``n`` shuffled embedding rows of the model (distinct real vectors)."""
    rows = model.probe.embedding.weight.detach().float().numpy()
    rng = np.random.default_rng(0)
    tasks = []
    for t in range(count):
        path = directory / f"x{t}.npy"
        np.save(path, rows[rng.choice(len(rows), size=n, replace=False)])
        tasks.append(
            LayerTask(str(path), t, str(directory / f"s{t}.json"), str(directory / f"nn{t}.npy"), progress=False)
        )
    return tasks


def clear(tasks: Sequence[LayerTask]) -> None:
    for task in tasks:
        Path(task.out_json).unlink(missing_ok=True)
        Path(task.out_nn).unlink(missing_ok=True)


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
    return {"wall": wall, "merge": merging, "bytes": shipped, **profile(runner.records, wall)}


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
    parser.add_argument("--n", type=int, default=16_000, help="vectors per search task")
    parser.add_argument("--tasks", type=int, default=8, help="search tasks")
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
        tasks = search_tasks(model, args.n, args.tasks, work)
        pairs = args.n * (args.n - 1) // 2
        prompts, _ = sample_prompts(model.tokenizer, "mixed", args.prompts, 16, 0)
        ids = [p.ids for p in prompts]
        layers = tuple(model.probe.layers("all"))
        chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
        encode = _Prompts(layers, 4096)
        print(f"machine: {torch.get_num_threads()} torch thread per worker; ray {ray.__version__}; model load "
              f"{load_seconds:.2f} s")  # fmt: skip
        print(f"\n[search] {args.tasks} tasks x {pairs:.3g} pairs (N={args.n}, d={model.probe.hidden_size})")
        search_runs: dict[str, dict[str, Any]] = {}
        encode_runs: dict[str, dict[str, Any]] = {}
        runners: list[tuple[str, Callable[[], Executor]]] = [
            ("in-process", InProcessExecutor),
            ("ray, 1 worker", lambda: RayExecutor(workers=1)),
            ("ray, 2 workers", lambda: RayExecutor(workers=2)),
        ]
        for label, make in runners:
            runner = make()
            clear(tasks)
            if label != "in-process":  # start the workers outside the timing (a cluster keeps them)
                runner.map(len, [[0]] * runner.workers)
            search_runs[label] = timed(runner, None, Plain(run_layer_task), tasks, lambda i, r: None)
            store = StateStore(work / f"store-{label[:6]}-{label[-9:]}", len(ids), model.probe.hidden_size,
                               [int(x) for x in layers], args.chunk)  # fmt: skip
            encode_runs[label] = timed(
                runner, ModelSetup.of(model), encode, chunks, lambda i, rows, s=store: s.write_chunk(i, rows)
            )
            getattr(runner, "close", lambda: None)()
            del runner
        for label, m in search_runs.items():
            show(label, m, args.tasks)
        compare("search", search_runs, args.tasks)
        rate = pairs / search_runs["in-process"]["task_median"]
        rate_w = args.tasks * pairs / search_runs["ray, 2 workers"]["wall"] / 2
        print(f"  per core: {rate:.3g} pairs/s in-process; {rate_w:.3g} pairs/s per worker with 2 workers")

        print(f"\n[encoding] {len(ids)} prompts x {len(layers)} layers in {len(chunks)} chunks of {args.chunk} "
              "(first task on each worker includes its model load)")  # fmt: skip
        for label, m in encode_runs.items():
            show(label, m, len(chunks))
        compare("encoding", encode_runs, len(chunks))

        efficiency = search_runs["ray, 1 worker"]["wall"] / search_runs["ray, 2 workers"]["wall"] / 2
        overhead = max(0.0, (search_runs["ray, 1 worker"]["wall"] - search_runs["in-process"]["wall"]) / args.tasks)
        machines = [int(x) for x in args.machines.split(",")]
        print(
            f"\n[projection] per-core rate {rate:.3g} pairs/s at d=576 (x576/4096 at d=4096), parallel efficiency "
            f"{efficiency:.0%} (measured 1 -> 2 workers), {overhead * 1e3:.0f} ms overhead per task; {args.cores} "
            "cores per machine"
        )
        for name, total in PAPER_RUNS.items():
            for d in (576, 4096):
                per_core = rate * 576 / d
                cells = []
                for n in machines:
                    workers = n * args.cores
                    tasks_needed = max(workers, int(total / 2e8))  # tiles of ~2×10⁸ pairs: enough for every core
                    seconds = total / (per_core * workers * efficiency) + overhead * tasks_needed / workers
                    cells.append(f"{n} machines: {_duration(seconds)}")
                print(f"  {name}, d={d}: " + "; ".join(cells))
        print(
            "  (a layer search is one task: a run has as many parallel tasks as layers x prefixes, so beyond that "
            "many workers the projection needs tile blocks of one layer, which the search does not split yet)"
        )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


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
