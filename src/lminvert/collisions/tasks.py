"""Units of search work: the exact pairwise search of one layer's stored states, or of a row block of it.

A task is a small picklable record (paths and settings), so an executor can run it in this process or on a
Ray worker that sees the same filesystem. A task whose outputs exist is not run again (resume).

A layer is searched in one task (:func:`run_layer_task`), or, when its :class:`LayerTask` lists row
``blocks``, in one :class:`BlockTask` per block (:func:`run_block_task`, each kept in
``search/layer_LLL.blocks/rows_A_B.npz``) followed by the layer task, which merges them
(:func:`~.search.merge_blocks`: the same result as one task), writes the layer's files and removes the blocks.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..models import Layer
from ..paths import atomic_file, read_json, write_json
from .search import BlockSearch, SearchResult, merge_blocks, pairwise_min, search_block
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
    blocks: tuple[tuple[int, int], ...] = ()  # row blocks searched as BlockTasks first (empty: one task)

    @property
    def done(self) -> bool:
        return Path(self.out_json).exists() and Path(self.out_nn).exists()

    @property
    def blocks_dir(self) -> Path:
        return Path(self.out_json).with_suffix(".blocks")


@dataclass(frozen=True)
class BlockTask:
    """Rows ``[a, b)`` of a layer's search, kept in the layer's blocks directory until the layer is merged."""

    layer: LayerTask
    rows: tuple[int, int]

    @property
    def path(self) -> Path:
        return self.layer.blocks_dir / f"rows_{self.rows[0]}_{self.rows[1]}.npz"


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


def block_tasks(tasks: Sequence[LayerTask]) -> list[BlockTask]:
    """The row blocks still to search of the layers not finished yet."""
    return [
        BlockTask(t, rows) for t in tasks if not t.done for rows in t.blocks if not BlockTask(t, rows).path.exists()
    ]


def run_block_task(task: BlockTask) -> str:
    """Search one row block (unless it is kept already) and keep it; return its file."""
    if not task.path.exists() and not task.layer.done:
        _search_block(task, np.load(task.layer.states_path)).save(task.path)
    return str(task.path)


def _search_block(task: BlockTask, x: np.ndarray) -> BlockSearch:
    layer = task.layer
    desc = f"{layer.desc} rows {task.rows[0]}-{task.rows[1]}"
    return search_block(x, layer.k, layer.threshold, layer.tile_rows, layer.tile_cols, task.rows, layer.progress, desc)


def _search(task: LayerTask, x: np.ndarray) -> SearchResult:
    """The layer's search: merged from its row blocks (the kept ones read back), or in one pass."""
    if not task.blocks:
        return pairwise_min(x, task.k, task.threshold, task.tile_rows, task.tile_cols, task.progress, task.desc)
    parts = []
    for rows in task.blocks:
        block = BlockTask(task, rows)
        parts.append(BlockSearch.load(block.path) if block.path.exists() else _search_block(block, x))
    return merge_blocks(parts)


def run_layer_task(task: LayerTask) -> dict[str, Any]:
    """Run (or load, if done before) one layer's search; return its JSON summary."""
    out_json, out_nn = Path(task.out_json), Path(task.out_nn)
    if task.done:
        log.info("layer %d: search already done, loading %s", task.layer, out_json)
        return read_json(out_json)
    x = np.load(task.states_path)
    n, d = x.shape
    result = _search(task, x)
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
            "blocks": stats.n_blocks,
            "max_sq_error_bound": stats.max_sq_error_bound,
            "mean_norm": stats.mean_norm,
            "max_norm": stats.max_norm,
            "offset_norm": stats.offset_norm,
        },
    }
    with atomic_file(out_nn) as tmp, tmp.open("wb") as handle:
        np.save(handle, result.nn_distance)
    write_json(out_json, summary)
    shutil.rmtree(task.blocks_dir, ignore_errors=True)  # merged: the layer's files hold everything now
    return summary
