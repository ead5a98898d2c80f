"""One unit of search work: the exact pairwise search of one layer's stored states, saved to disk.

A task is a small picklable record (paths and settings), so an executor can run it in this process or on a
Ray worker that sees the same filesystem. A task whose outputs exist is not run again (resume).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..models import Layer
from ..paths import atomic_file, read_json, write_json
from .search import pairwise_min
from .store import StateStore
from .summary import log_histogram, nn_spot_check, pair_sample, quantiles

log = logging.getLogger(__name__)

MAX_IN_JSON = 1000  # pairs under the threshold listed in a layer's summary (all are counted)


@dataclass(frozen=True)
class LayerTask:
    """Search ``states_path`` (an ``[N, d]`` float32 .npy); write ``out_json`` and the NN distances ``out_nn``."""

    states_path: str
    layer: int
    out_json: str
    out_nn: str
    k: int = 10
    threshold: float = 1e-6
    tile_rows: int = 1024
    tile_cols: int = 4096
    seed: int = 0
    progress: bool = True
    desc: str = "pairs"
    pair_sample_size: int = 100_000


def layer_tasks(
    store: StateStore, base: Path, layers: Sequence[Layer], label: str = "", **settings: Any
) -> list[LayerTask]:
    """One :class:`LayerTask` per layer (those of ``store``), writing to ``base/search/`` (created)."""
    (base / "search").mkdir(parents=True, exist_ok=True)
    return [
        LayerTask(
            states_path=str(store.path(layer)),
            layer=int(layer),
            out_json=str(base / "search" / f"layer_{layer:03d}.json"),
            out_nn=str(base / "search" / f"nn_{layer:03d}.npy"),
            desc=f"{label}layer {layer.name}",
            **settings,
        )
        for layer in layers
    ]


def run_layer_task(task: LayerTask) -> dict[str, Any]:
    """Run (or load, if done before) one layer's search; return its JSON summary."""
    out_json, out_nn = Path(task.out_json), Path(task.out_nn)
    if out_json.exists() and out_nn.exists():
        log.info("layer %d: search already done, loading %s", task.layer, out_json)
        return read_json(out_json)
    x = np.load(task.states_path)
    n, d = x.shape
    result = pairwise_min(
        x,
        k=task.k,
        threshold=task.threshold,
        tile_rows=task.tile_rows,
        tile_cols=task.tile_cols,
        progress=task.progress,
        desc=task.desc,
    )
    stats = result.stats
    summary = {
        "layer": task.layer,
        "n": n,
        "d": d,
        "n_pairs": stats.n_pairs,
        "min_distance": result.min_distance,
        "closest": [[p.i, p.j, p.distance] for p in result.closest],
        "n_below_threshold": result.n_below_threshold,
        "threshold": result.threshold,
        "below_threshold": [[p.i, p.j, p.distance] for p in result.below_threshold[:MAX_IN_JSON]],
        "nn_quantiles": quantiles(result.nn_distance),
        "nn_histogram": log_histogram(result.nn_distance),
        "nn_exact_count": int(result.nn_exact.sum()),
        "nn_error_bound": result.nn_error_bound,
        "nn_spot_check": nn_spot_check(x, result.nn_distance, seed=task.seed),
        "pair_sample": pair_sample(x, size=min(task.pair_sample_size, max(1000, stats.n_pairs)), seed=task.seed),
        "search": {
            "seconds": stats.seconds,
            "prepare_seconds": stats.prepare_seconds,
            "gemm_seconds": stats.gemm_seconds,
            "reduce_seconds": stats.reduce_seconds,
            "exact_seconds": stats.exact_seconds,
            "pairs_per_second": stats.pairs_per_second,
            "pair_flops": stats.pair_flops,
            "achieved_flops_per_second": stats.pair_flops / stats.seconds,
            "n_exact": stats.n_exact,
            "n_tiles": stats.n_tiles,
            "n_tiles_scanned": stats.n_tiles_scanned,
            "tile_rows": stats.tile_rows,
            "tile_cols": stats.tile_cols,
            "max_sq_error_bound": stats.max_sq_error_bound,
            "mean_norm": stats.mean_norm,
            "max_norm": stats.max_norm,
            "offset_norm": stats.offset_norm,
        },
    }
    with atomic_file(out_nn) as tmp, tmp.open("wb") as handle:
        np.save(handle, result.nn_distance)
    write_json(out_json, summary)
    return summary
