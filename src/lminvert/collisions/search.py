"""Exact minimum pairwise L2 distance over N vectors, blocked so that the N×N matrix never exists.

Algorithm (one pass over the upper triangle):

1. Centre the vectors on their mean, held in the input dtype so that ``x - μ`` rounds once (distances are
   translation invariant; centring shrinks the norms that the rounding error is proportional to), and round
   them to float32: ``a_i``. Build two operands with one
   augmented column, ``P_i = [a_i, fl32(‖a_i‖²)]`` and ``Q_j = [-2 a_j, 1]``, and a bias ``fl32(‖a_j‖²)``.
2. For each tile (rows ``R``, columns ``C`` of the upper triangle) one fused ``torch.addmm(bias, P, Qᵀ)`` gives
   every squared distance of the tile; a row-wise and a column-wise minimum (numpy, over the cache-resident
   tile) update each vector's nearest-neighbour value. Nothing else touches the whole tile: the GEMM dominates.
3. Exactness: :mod:`.bounds` bounds the rounding error of every computed value. A running set of exactly
   measured pairs gives ``τ``, the k-th smallest exact squared distance so far; with ``T = max(τ, threshold²)``
   a row of a tile can hold a pair with exact squared distance <= T only if its row minimum is under the
   rigorous cutoff. Only such rows are scanned; their pairs under the cutoff are re-measured in float64
   from the input vectors themselves (``Σ (x_ik - x_jk)²``). Since τ only decreases, one pass suffices: every
   pair among the k closest, and every pair under the threshold, is measured exactly and counted once.

The nearest-neighbour distance of each vector is exact (float64) whenever it is at most ``√τ`` at the end
(those pairs were all measured); otherwise it is the float32 GEMM value, within the bound reported in the
stats, and never below ``√τ``.

Row blocks: :func:`search_block` runs the pass above over the tiles of a range of row chunks only (rows
``[a, b)`` against every column ``j > i``), so a layer can be split into independent tasks
(:func:`row_blocks`). :func:`merge_blocks` combines them exactly: the blocks' kept pairs are a superset of the
global k closest (a block's τ is never below the global one), the threshold counts add up, the float32
nearest-neighbour minima are taken elementwise. Blocks start and end on the tile-row boundaries of the whole
search, so every tile, and every GEMM value, is the same as in one pass: the merged result equals
:func:`pairwise_min`'s, which is itself the merge of one block. Only the work counters (pairs re-measured,
tiles scanned) depend on the split.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import LminvertError
from ..paths import atomic_file
from . import bounds
from .best import Best, Pair, exact_pass, max_keep, nearest
from .operands import ArrayLike, Operands, check_input, chunks, ieee_float32_matmul, padded_width, prepare, tile_shape

log = logging.getLogger(__name__)

DEFAULT_TILE_ROWS = 1024
DEFAULT_TILE_COLS = 4096


@dataclass(frozen=True)
class SearchStats:
    """How the search ran: sizes, work and time."""

    n: int
    d: int
    n_pairs: int
    tile_rows: int
    tile_cols: int
    n_tiles: int
    n_tiles_scanned: int  # tiles whose row minima fell under the cutoff
    n_exact: int  # pairs re-measured in float64
    seconds: float
    prepare_seconds: float
    gemm_seconds: float
    reduce_seconds: float
    exact_seconds: float
    max_sq_error_bound: float  # largest GEMM error bound on a squared distance (squared units)
    mean_norm: float  # mean norm of the centred vectors
    max_norm: float  # largest norm of the centred vectors
    offset_norm: float  # norm of the mean that was subtracted
    n_blocks: int = 1  # row blocks the search was split into (seconds: their sum, plus the merge)

    @property
    def pairs_per_second(self) -> float:
        return self.n_pairs / self.seconds if self.seconds > 0 else float("nan")

    @property
    def pair_flops(self) -> float:
        """Useful floating-point work: 2·d flops per pair (the dot product a GEMM must do for it)."""
        return 2.0 * self.d * self.n_pairs


@dataclass(frozen=True, eq=False)
class SearchResult:
    """Exact minimum, k closest pairs, threshold count and nearest-neighbour distances of N vectors."""

    min_distance: float
    closest: tuple[Pair, ...]
    n_below_threshold: int
    threshold: float
    below_threshold: tuple[Pair, ...]  # pairs under the threshold, sorted (the first MAX_LISTED found; all counted)
    nn_distance: np.ndarray = field(repr=False)  # [N] float64
    nn_exact: np.ndarray = field(repr=False)  # [N] bool: nn_distance is a float64 measurement
    stats: SearchStats

    @property
    def nn_error_bound(self) -> float:
        """Bound on |reported - exact| for the nearest-neighbour distances that are not exact (distance units)."""
        stats = self.stats
        return math.sqrt(stats.max_sq_error_bound) + float(bounds.cast_error_bound(stats.max_norm, stats.max_norm))


@dataclass(frozen=True, eq=False)
class BlockSearch:
    """One row block's share of a search (rows ``[a, b)`` against every column ``j > i``), ready to merge.

    ``i``/``j``/``d2``: the exactly measured pairs that can be among the block's k closest (a superset of the
    global k closest that fall in the block); ``below_*``: the pairs under the threshold in the order found
    (the first MAX_LISTED); ``nn_sq``: the float32 GEMM minimum of every vector ``rows[0]..n-1``.
    """

    n: int
    d: int
    rows: tuple[int, int]
    k: int
    threshold: float
    tile_rows: int
    tile_cols: int
    n_pairs: int
    i: np.ndarray = field(repr=False)
    j: np.ndarray = field(repr=False)
    d2: np.ndarray = field(repr=False)
    n_below: int
    below_i: np.ndarray = field(repr=False)
    below_j: np.ndarray = field(repr=False)
    below_d2: np.ndarray = field(repr=False)
    nn_sq: np.ndarray = field(repr=False)
    n_tiles: int
    n_tiles_scanned: int
    n_exact: int
    seconds: float
    prepare_seconds: float
    gemm_seconds: float
    reduce_seconds: float
    exact_seconds: float
    max_sq_error_bound: float
    mean_norm: float
    max_norm: float
    offset_norm: float

    def save(self, path: str | Path) -> None:
        """Write the block to an .npz file (atomically), for :meth:`load`."""
        with atomic_file(path) as tmp, tmp.open("wb") as handle:
            np.savez(handle, **{f.name: np.asarray(getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def load(cls, path: str | Path) -> BlockSearch:
        with np.load(path, allow_pickle=False) as data:
            values = {name: data[name] for name in data.files}
        out: dict[str, object] = {}
        for f in fields(cls):
            value = values[f.name]
            out[f.name] = value.item() if value.ndim == 0 else value
        out["rows"] = (int(values["rows"][0]), int(values["rows"][1]))
        return cls(**out)  # type: ignore[arg-type]


def block_pairs(n: int, rows: tuple[int, int]) -> int:
    """Pairs ``(i, j)``, ``j > i``, with ``i`` in ``[a, b)``."""
    a, b = rows
    return (b - a) * (2 * n - a - b - 1) // 2


def row_blocks(n: int, tile_rows: int, tile_cols: int, pairs_per_block: int | None) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` that cover all N(N-1)/2 pairs, each about ``pairs_per_block`` pairs (None or 0: one).

    Boundaries fall on the search's tile rows (so the blocks see exactly the tiles of one pass); a block holds
    at least one tile row, so for small N there may be fewer blocks than asked for.
    """
    if n < 2:
        raise LminvertError(f"need at least 2 vectors to compare, got {n}")
    if pairs_per_block is not None and pairs_per_block < 0:
        raise LminvertError("the pairs per search block must be positive (0: one block per layer)")
    if not pairs_per_block:
        return [(0, n - 1)]
    step = tile_shape(n, tile_rows, tile_cols)[0]
    blocks: list[tuple[int, int]] = []
    start = 0
    for _, r1 in chunks(n - 1, step):
        if block_pairs(n, (start, r1)) >= pairs_per_block or r1 == n - 1:
            blocks.append((start, r1))
            start = r1
    return blocks


def pairwise_min(
    x: ArrayLike,
    k: int = 10,
    threshold: float = 1e-6,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_cols: int = DEFAULT_TILE_COLS,
    progress: bool = False,
    desc: str = "pairs",
) -> SearchResult:
    """Exact minimum distance, the ``k`` closest pairs and the count of pairs closer than ``threshold``.

    ``x`` is ``[N, d]`` (float32 or float64; numpy, memmap or torch). Exact means: equal to a float64
    brute force ``Σ_k (x_ik - x_jk)²`` over all N(N-1)/2 pairs, whatever the rounding of the float32 GEMM.
    """
    return merge_blocks([search_block(x, k, threshold, tile_rows, tile_cols, None, progress, desc)])


def search_block(
    x: ArrayLike,
    k: int = 10,
    threshold: float = 1e-6,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_cols: int = DEFAULT_TILE_COLS,
    rows: tuple[int, int] | None = None,
    progress: bool = False,
    desc: str = "pairs",
) -> BlockSearch:
    """The search over the pairs whose first vector is in ``rows`` = ``[a, b)`` (None: all pairs), for
    :func:`merge_blocks`. ``a`` and ``b`` must be tile-row boundaries of the whole search (:func:`row_blocks`)."""
    n, _ = check_input(x)
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
    if k < 1:
        raise LminvertError("k must be at least 1")
    if not threshold >= 0:
        raise LminvertError("the collision threshold must be a non-negative number")
    tile_r, tile_c = tile_shape(n, tile_rows, tile_cols)
    first, last = (0, n - 1) if rows is None else (int(rows[0]), int(rows[1]))
    if not (0 <= first < last <= n - 1 and first % tile_r == 0 and (last % tile_r == 0 or last == n - 1)):
        raise LminvertError(f"row block [{first}, {last}) does not start and end on a tile row of {n} vectors")
    start = time.perf_counter()
    with ieee_float32_matmul(), torch.no_grad():
        scan = _Scan(x, prepare(x), Best(k, threshold, max_keep=max_keep(k)), tile_r)
        scan.prepare_seconds = time.perf_counter() - start
        bar = tqdm(
            total=block_pairs(n, (first, last)), desc=desc, unit="pair", unit_scale=True,
            disable=None if progress else True, leave=False,
        )  # fmt: skip
        for r0, r1 in chunks(n - 1, tile_r):
            if first <= r0 < last:
                for c0 in range(r0, n, tile_c):
                    bar.update(scan.tile(r0, r1, c0, min(c0 + tile_c, n)))
        bar.close()
    return scan.block((first, last), tile_c, time.perf_counter() - start)


class _Scan:
    """One pass over tiles: each tile's GEMM, its row and column minima, and its exact re-measurement (step 2 and 3
    of the module's algorithm), with the work and time counters of :class:`BlockSearch`."""

    def __init__(self, x: ArrayLike, ops: Operands, best: Best, tile_r: int) -> None:
        n, d = x.shape
        self.x, self.ops, self.best, self.tile_r = x, ops, best, tile_r
        self.norm = ops.norm.numpy()
        self.terms = padded_width(d) - 1  # products per dot (zero padding included): the bound's d, conservatively
        self.nn_sq = np.full(n, np.inf, dtype=np.float32)
        self.tril = np.tri(min(tile_r, n), dtype=bool)  # lower triangle with the diagonal: pairs j <= i
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.gemm_seconds = self.reduce_seconds = self.exact_seconds = self.prepare_seconds = 0.0
        self.n_tiles = self.n_scanned = 0
        self.max_bound = 0.0

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> int:
        """Rows ``[r0, r1)`` against columns ``[c0, c1)``; returns the pairs it covered."""
        ops, norm, nn_sq = self.ops, self.norm, self.nn_sq
        shape = (r1 - r0, c1 - c0)
        tile = self.buffers.get(shape)
        if tile is None:
            tile = self.buffers[shape] = torch.empty(shape, dtype=torch.float32)
        t0 = time.perf_counter()
        torch.addmm(ops.bias[c0:c1].unsqueeze(0), ops.P[r0:r1], ops.Q[c0:c1].T, out=tile)
        t1 = time.perf_counter()
        # The reductions run in numpy, single-threaded: streaming over a cache-resident tile is
        # memory-bound, and short OpenMP regions stall whenever a core is busy elsewhere.
        values = tile.numpy()
        masked = 0
        if c0 == r0:  # the diagonal square: keep only j > i
            side = r1 - r0
            np.putmask(values[:, :side], self.tril[:side, :side], np.inf)
            masked = side * (side + 1) // 2
        row_min, col_min = values.min(axis=1), values.min(axis=0)
        np.minimum(nn_sq[r0:r1], row_min, out=nn_sq[r0:r1])
        np.minimum(nn_sq[c0:c1], col_min, out=nn_sq[c0:c1])
        t2 = time.perf_counter()
        row_norm = norm[r0:r1]
        col_norm_max = float(norm[c0:c1].max())
        bound = float(bounds.sq_error_bound(float(row_norm.max()), col_norm_max, self.terms))
        self.max_bound = max(self.max_bound, bound)
        valid = shape[0] * shape[1] - masked
        scanned = exact_pass(
            self.x, values, valid, r0, c0, row_min, row_norm, col_norm_max, norm, self.best, self.terms
        )
        t3 = time.perf_counter()
        self.n_tiles += 1
        self.n_scanned += int(scanned)
        self.gemm_seconds += t1 - t0
        self.reduce_seconds += t2 - t1
        self.exact_seconds += t3 - t2
        return valid

    def block(self, rows: tuple[int, int], tile_c: int, seconds: float) -> BlockSearch:
        """What the tiles of ``rows`` found, as a :class:`BlockSearch`."""
        best, ops = self.best, self.ops
        n, d = self.x.shape
        below = np.array([(i, j) for _, i, j in best.below], dtype=np.int64).reshape(-1, 2)
        return BlockSearch(
            n=n, d=d, rows=rows, k=best.k, threshold=best.threshold, tile_rows=self.tile_r, tile_cols=tile_c,
            n_pairs=block_pairs(n, rows), i=best.i, j=best.j, d2=best.d2, n_below=best.n_below,
            below_i=below[:, 0], below_j=below[:, 1],
            below_d2=np.array([v for v, _, _ in best.below], dtype=np.float64), nn_sq=self.nn_sq[rows[0] :],
            n_tiles=self.n_tiles, n_tiles_scanned=self.n_scanned, n_exact=best.n_exact, seconds=seconds,
            prepare_seconds=self.prepare_seconds, gemm_seconds=self.gemm_seconds, reduce_seconds=self.reduce_seconds,
            exact_seconds=self.exact_seconds, max_sq_error_bound=self.max_bound, mean_norm=float(ops.norm.mean()),
            max_norm=float(ops.norm.max()), offset_norm=ops.offset_norm,
        )  # fmt: skip


_SUMMED = ("n_tiles", "n_tiles_scanned", "prepare_seconds", "gemm_seconds", "reduce_seconds", "exact_seconds")


def merge_blocks(blocks: Sequence[BlockSearch]) -> SearchResult:
    """The search result of blocks that cover every row once (in any order): equal to one pass over all rows."""
    if not blocks:
        raise LminvertError("no search blocks to merge")
    parts = sorted(blocks, key=lambda b: b.rows)
    one = parts[0]
    n, k, threshold = one.n, one.k, one.threshold
    setting = (one.n, one.d, one.k, one.threshold, one.tile_rows, one.tile_cols)
    if any((b.n, b.d, b.k, b.threshold, b.tile_rows, b.tile_cols) != setting for b in parts):
        raise LminvertError("search blocks of different searches (vectors, k, threshold or tile) cannot be merged")
    edges = [0] + [b for part in parts for b in part.rows] + [n - 1]
    if edges[0::2] != edges[1::2]:
        raise LminvertError(f"search blocks {[p.rows for p in parts]} do not cover rows [0, {n - 1}) once each")
    start = time.perf_counter()
    best = Best(k, threshold, max_keep=max_keep(k))
    best.keep(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("i", "j", "d2")))
    best.n_below = sum(p.n_below for p in parts)
    best.n_exact = sum(p.n_exact for p in parts)
    listed = (zip(p.below_d2.tolist(), p.below_i.tolist(), p.below_j.tolist(), strict=True) for p in parts)
    best.below = [item for found in listed for item in found][: best.listed]  # in the order one pass finds them
    nn_sq = np.full(n, np.inf, dtype=np.float32)
    for p in parts:
        np.minimum(nn_sq[p.rows[0] :], p.nn_sq, out=nn_sq[p.rows[0] :])
    nn_distance, nn_exact = nearest(nn_sq.astype(np.float64), best, n)
    closest = best.sorted_pairs()[:k]
    total = {name: sum(getattr(p, name) for p in parts) for name in _SUMMED}
    stats = SearchStats(
        n=n, d=one.d, n_pairs=n * (n - 1) // 2, tile_rows=one.tile_rows, tile_cols=one.tile_cols, **total,
        n_exact=best.n_exact, seconds=sum(p.seconds for p in parts) + time.perf_counter() - start,
        max_sq_error_bound=max(p.max_sq_error_bound for p in parts), mean_norm=one.mean_norm, max_norm=one.max_norm,
        offset_norm=one.offset_norm, n_blocks=len(parts),
    )  # fmt: skip
    log.info(
        "%d vectors (d=%d): min %.6g, %d below %.3g; %.3g pairs/s, %d pairs re-measured in float64",
        n, one.d, closest[0].distance, best.n_below, threshold, stats.pairs_per_second, best.n_exact,
    )  # fmt: skip
    return SearchResult(
        min_distance=closest[0].distance,
        closest=tuple(closest),
        n_below_threshold=best.n_below,
        threshold=threshold,
        below_threshold=tuple(Pair(i, j, math.sqrt(v)) for v, i, j in sorted(best.below)),
        nn_distance=nn_distance,
        nn_exact=nn_exact,
        stats=stats,
    )
