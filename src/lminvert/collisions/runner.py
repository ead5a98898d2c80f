"""The one runner behind the collision search and the exhaustive test: states -> per-layer exact searches.

Both commands do the same thing to a set of N vectors per layer: fill a resumable :class:`~.store.StateStore`,
search each layer exactly (one :class:`~.tasks.LayerTask` per layer, mapped by an executor; on workers, a
layer's rows are split first into :class:`~.tasks.BlockTask` row blocks of about ``block_pairs`` pairs, so
that one layer keeps many workers busy, and the layer task merges them), estimate the
rounding noise of the stored states (a resumable step), and turn the task summaries into
:class:`~.results.LayerResult` values. They differ only in how the store is filled and what extra each layer
reports (tied tokens for the exhaustive test), which the caller passes in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LminvertError
from ..executors import Executor
from ..models import Layer, LoadedModel
from ..runs import RunDirectory, run_metadata
from .results import LayerResult, layer_result, overall_throughput
from .search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS, row_blocks
from .store import StateStore
from .tasks import block_tasks, layer_tasks, run_block_task, run_layer_task
from .throughput import matmul_reference

ROUNDING_NOISE = "rounding_noise.json"
DEFAULT_BLOCK_PAIRS = 200_000_000  # pairs per search task on workers, unless set (~10 s for one core at d=576)
MIN_BLOCK_PAIRS = 10_000_000  # smaller layers are not split unless asked (a task costs ~10 ms on Ray)


@dataclass(frozen=True)
class SearchSettings:
    """How each layer is searched: what counts as a collision, how many closest pairs to keep, tile shape, and
    the pairs per search task (``block_pairs``; 0: one task per layer; None: one task per layer in this
    process, on workers enough blocks of up to ``DEFAULT_BLOCK_PAIRS`` to keep every worker busy)."""

    threshold: float = 1e-6
    k: int = 10
    seed: int = 0
    tile_rows: int = DEFAULT_TILE_ROWS
    tile_cols: int = DEFAULT_TILE_COLS
    block_pairs: int | None = None

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise LminvertError("--threshold must be a non-negative number")
        if self.k < 1:
            raise LminvertError("--k must be at least 1")
        if self.tile_rows < 1 or self.tile_cols < 1:
            raise LminvertError("--tile-rows and --tile-cols must be positive")
        if self.block_pairs is not None and self.block_pairs < 0:
            raise LminvertError("--block-pairs must be a positive number of pairs (0: one task per layer)")

    def pairs_per_block(self, executor: Executor, n: int, n_layers: int) -> int:
        """The pairs per search task for ``n_layers`` layers of ``n`` vectors on ``executor`` (0: no split)."""
        if self.block_pairs is not None:
            return self.block_pairs
        if executor.name == "inprocess":
            return 0
        per_worker = -(-(n * (n - 1) // 2) * n_layers // (2 * executor.workers))  # two tasks per worker at least
        return max(MIN_BLOCK_PAIRS, min(DEFAULT_BLOCK_PAIRS, per_worker))


@dataclass(frozen=True)
class SearchedStates:
    """One store, searched: per-layer task summaries, rounding noise, where the NN distances are."""

    store: StateStore
    summaries: dict[Layer, dict[str, Any]]
    rounding_noise: dict[str, dict]  # keys: layer index as text
    nn_files: dict[str, str]  # layer name -> .npy path, relative to the run directory
    encode_seconds: float

    def states(self, layer: Layer) -> np.ndarray:
        """The stored ``[n, d]`` float32 states of ``layer`` (read-only memmap)."""
        return self.store.layer(int(layer))


def search_states(
    run: RunDirectory,
    subdir: str,
    model: LoadedModel,
    layers: Sequence[Layer],
    n: int,
    chunk_size: int,
    fill: Callable[[StateStore], float],
    rounding_noise: Callable[[StateStore], dict[str, dict]],
    settings: SearchSettings,
    executor: Executor,
    k: int | None = None,
    label: str = "",
    progress: bool = True,
) -> SearchedStates:
    """Fill (or resume) the store in ``run/subdir``, search every layer, estimate the rounding noise.

    ``k`` overrides ``settings.k`` for the search itself (the exhaustive test searches past its tied pairs).
    """
    directory = run.path / subdir if subdir else run.path
    store = StateStore(directory / "states", n, model.probe.hidden_size, [int(x) for x in layers], chunk_size)
    encode_seconds = fill(store)
    if not store.complete:
        raise LminvertError(f"{directory}: encoding did not finish; rerun the same command to resume")
    tasks = layer_tasks(
        store,
        directory,
        layers,
        label,
        k=settings.k if k is None else k,
        threshold=settings.threshold,
        tile_rows=settings.tile_rows,
        tile_cols=settings.tile_cols,
        seed=settings.seed,
        progress=progress,
        blocks=_blocks(n, settings, settings.pairs_per_block(executor, n, len(layers))),
    )
    executor.map(run_block_task, block_tasks(tasks))  # nothing to do unless layers are split
    summaries = executor.map(run_layer_task, tasks)
    noise_file = f"{subdir}/{ROUNDING_NOISE}" if subdir else ROUNDING_NOISE
    rounding = run.step(noise_file, lambda: rounding_noise(store))
    by_layer = dict(zip(layers, summaries, strict=True))
    nn_files = {layer.name: str(Path(t.out_nn).relative_to(run.path)) for layer, t in zip(layers, tasks, strict=True)}
    return SearchedStates(store, by_layer, rounding, nn_files, encode_seconds)


def _blocks(n: int, settings: SearchSettings, pairs_per_block: int) -> tuple[tuple[int, int], ...]:
    blocks = row_blocks(n, settings.tile_rows, settings.tile_cols, pairs_per_block)
    return tuple(blocks) if len(blocks) > 1 else ()


def layer_results(
    searched: SearchedStates,
    ids: Sequence[tuple[int, ...]],
    texts: Sequence[str],
    tied: dict[int, int],
    matmul: dict[str, Any],
    extra: Callable[[Layer, dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, LayerResult]:
    """Layer name -> :class:`LayerResult`, each with its rounding noise and its matmul fraction against the
    run's reference; ``extra(layer, summary)`` adds caller-specific details."""
    out = {}
    for layer, summary in searched.summaries.items():
        search = dict(summary["search"])
        search["matmul_fraction"] = search["achieved_flops_per_second"] / matmul["flops_per_second"]
        details = {"rounding_noise": searched.rounding_noise[str(int(layer))]}
        details.update(extra(layer, summary) if extra else {})
        out[layer.name] = layer_result({**summary, "search": search}, layer.name, list(ids), list(texts), tied, details)
    return out


def measure_matmul(n: int, d: int, settings: SearchSettings, earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's matmul reference at its tile shape: measured before the searches, then again after them
    (``earlier``: the first measurement), the median of both sets."""
    return matmul_reference(n, d, settings.tile_rows, settings.tile_cols, earlier=earlier)


def run_summary(
    model: LoadedModel, layers: Sequence[LayerResult], matmul: dict[str, Any], timings: dict[str, Any], seed: int
) -> dict[str, Any]:
    """Throughput, timings and run metadata: the part of results.json every search run shares."""
    throughput = overall_throughput(list(layers), matmul)
    timings = {**timings, "search_seconds": throughput["search_seconds"]}
    return {"throughput": throughput, "timings": timings, **run_metadata(model.describe(), seed)}


def elapsed(start: float) -> float:
    return time.perf_counter() - start
