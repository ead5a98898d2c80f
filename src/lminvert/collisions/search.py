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

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import LminvertError
from ..paths import atomic_file
from . import bounds

log = logging.getLogger(__name__)

ArrayLike = np.ndarray | torch.Tensor

DEFAULT_TILE_ROWS = 1024
DEFAULT_TILE_COLS = 4096
_EXACT_CHUNK = 8192  # pairs re-measured per float64 batch
MAX_LISTED = 10_000  # pairs under the threshold listed individually (all are counted)


@dataclass(frozen=True)
class Pair:
    """Two vectors (indices ``i < j``) and their exact float64 distance."""

    i: int
    j: int
    distance: float


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


def exact_sq_distances(x: ArrayLike, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``Σ_k (x_ik - x_jk)²`` in float64, from the vectors themselves (float32 inputs are widened exactly)."""
    out = np.empty(len(i), dtype=np.float64)
    for start in range(0, len(i), _EXACT_CHUNK):
        stop = start + _EXACT_CHUNK
        a = _rows64(x, i[start:stop])
        b = _rows64(x, j[start:stop])
        diff = a - b
        out[start:stop] = np.einsum("ij,ij->i", diff, diff)
    return out


def _rows64(x: ArrayLike, index: np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x[torch.from_numpy(np.asarray(index, dtype=np.int64))].double().numpy()
    return np.asarray(x[np.asarray(index, dtype=np.int64)], dtype=np.float64)


def tile_shape(n: int, tile_rows: int, tile_cols: int) -> tuple[int, int]:
    """The tile the search uses for N vectors: rows capped near N/8 for small N, columns >= rows."""
    # the diagonal tiles waste half their work: for small N, shorter row blocks keep that waste near 1/8
    rows = max(1, min(int(tile_rows), max(256, -(-n // 8 // 64) * 64)))
    return rows, max(rows, int(tile_cols))  # the diagonal square must fit in the first column chunk


def _check_input(x: ArrayLike) -> tuple[int, int]:
    if x.ndim != 2:
        raise LminvertError(f"expected a [N, d] array of vectors, got shape {list(x.shape)}")
    n, d = int(x.shape[0]), int(x.shape[1])
    if n < 2:
        raise LminvertError(f"need at least 2 vectors to compare, got {n}")
    if d < 1:
        raise LminvertError("vectors have dimension 0")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype not in ("float32", "float64"):
        raise LminvertError(f"vectors must be float32 or float64, got {dtype}")
    return n, d


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)


@dataclass
class _Operands:
    P: torch.Tensor  # [N, w] float32: [a, fl32(|a|²), 0...] (w = padded_width(d))
    Q: torch.Tensor  # [N, w] float32: [-2a, 1, 0...]
    bias: torch.Tensor  # [N] float32: fl32(|a|²)
    norm: torch.Tensor  # [N] float64: |a| (of the float32 vectors)
    offset_norm: float


def padded_width(d: int) -> int:
    """Columns of the GEMM operands: d, the norm column, zeros up to a multiple of 4 (MKL runs 577 ~7 % slower)."""
    return -(-(d + 1) // 4) * 4


def _as_tensor(x: ArrayLike) -> torch.Tensor:
    """A zero-copy torch view of ``x`` where possible (numpy arrays and memmaps included)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.from_numpy(np.asarray(x))


def _prepare(x: ArrayLike, chunk: int = 8192) -> _Operands:
    """Centre on the mean (held in the input dtype: any translation will do), round once to float32."""
    xt = _as_tensor(x)
    n, d = xt.shape
    mean = xt.mean(dim=0)  # in the input dtype, so ``x - mean`` below rounds once
    width = padded_width(d)
    P = torch.zeros(n, width, dtype=torch.float32)  # the padding columns stay 0: exact, they add no rounding
    Q = torch.zeros(n, width, dtype=torch.float32)
    sq = np.empty(n, dtype=np.float64)
    P_np = P.numpy()
    for start, stop in _chunks(n, chunk):
        if xt.dtype == torch.float32:
            torch.sub(xt[start:stop], mean, out=P[start:stop, :d])
        else:
            P[start:stop, :d] = (xt[start:stop] - mean).float()
        a = P_np[start:stop, :d]
        sq[start:stop] = np.einsum("ij,ij->i", a, a, dtype=np.float64)
        torch.mul(P[start:stop, :d], -2.0, out=Q[start:stop, :d])
    if not np.isfinite(sq).all():  # NaN/inf anywhere in x reaches the mean or the row's norm
        raise LminvertError("vectors contain NaN or inf (or are too large for float32 after centring): check the input")
    if float(sq.max()) >= 1e36:
        raise LminvertError("vectors are too large for float32 squared distances (norm > 1e18): rescale them first")
    sq_t = torch.from_numpy(sq)
    P[:, d] = sq_t.float()
    Q[:, d] = 1.0
    return _Operands(P, Q, P[:, d].clone(), sq_t.sqrt(), float(mean.double().norm()))


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Make sure float32 GEMMs really run in float32 (no TF32 / bf16 shortcuts that void the bound)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class _Best:
    """Exactly measured pairs that can still be among the k closest; the running τ; the threshold count."""

    def __init__(self, k: int, threshold: float, max_keep: int) -> None:
        self.k = k
        self.thr_sq = threshold * threshold
        self.threshold = threshold
        self.max_keep = max(max_keep, k)
        self.i = np.empty(0, dtype=np.int64)
        self.j = np.empty(0, dtype=np.int64)
        self.d2 = np.empty(0, dtype=np.float64)
        self.n_below = 0
        self.n_exact = 0
        self.below: list[tuple[float, int, int]] = []

    @property
    def tau(self) -> float:
        return float(self.d2.max()) if len(self.d2) >= self.k else math.inf

    @property
    def cutoff(self) -> float:
        return max(self.tau, self.thr_sq)

    def add(self, i: np.ndarray, j: np.ndarray, d2: np.ndarray) -> None:
        """Pairs measured exactly (each pair is offered once): count them, keep those that can still be top-k."""
        self.n_exact += len(d2)
        under = np.flatnonzero(np.sqrt(d2) < self.threshold)
        self.n_below += len(under)
        room = MAX_LISTED - len(self.below)
        self.below += [(float(d2[u]), int(i[u]), int(j[u])) for u in under[: max(room, 0)]]
        self.keep(i, j, d2)

    def keep(self, i: np.ndarray, j: np.ndarray, d2: np.ndarray) -> None:
        """Add measured pairs to the kept set and drop those that cannot be among the k closest any more."""
        self.i = np.concatenate([self.i, i])
        self.j = np.concatenate([self.j, j])
        self.d2 = np.concatenate([self.d2, d2])
        if len(self.d2) > self.k:
            tau = np.partition(self.d2, self.k - 1)[self.k - 1]
            keep = self.d2 <= tau
            if keep.sum() > self.max_keep:  # exact ties at tau: keep the first max_keep by (d2, i, j)
                order = np.lexsort((self.j, self.i, self.d2))[: self.max_keep]
                keep = np.zeros(len(self.d2), dtype=bool)
                keep[order] = True
            self.i, self.j, self.d2 = self.i[keep], self.j[keep], self.d2[keep]

    def tau_with(self, d2: np.ndarray) -> float:
        """τ if ``d2`` were added (without adding them)."""
        both = np.concatenate([self.d2, d2])
        return float(np.partition(both, self.k - 1)[self.k - 1]) if len(both) >= self.k else math.inf

    def sorted_pairs(self) -> list[Pair]:
        order = np.lexsort((self.j, self.i, self.d2))
        return [Pair(int(self.i[o]), int(self.j[o]), math.sqrt(float(self.d2[o]))) for o in order]


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
    for _, r1 in _chunks(n - 1, step):
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
    n, d = _check_input(x)
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
    n_pairs = block_pairs(n, (first, last))
    start = time.perf_counter()
    with ieee_float32_matmul(), torch.no_grad():
        ops = _prepare(x)
        prepared = time.perf_counter()
        best = _Best(k, threshold, max_keep=_max_keep(k))
        norm = ops.norm.numpy()
        terms = padded_width(d) - 1  # products per dot (zero padding included): the bound's d, conservatively
        nn_sq = np.full(n, np.inf, dtype=np.float32)
        tril = np.tri(min(tile_r, n), dtype=bool)  # lower triangle with the diagonal: pairs j <= i
        buffers: dict[tuple[int, int], torch.Tensor] = {}
        t_gemm = t_reduce = t_exact = 0.0
        n_tiles = n_scanned = 0
        max_bound = 0.0
        bar = tqdm(
            total=n_pairs, desc=desc, unit="pair", unit_scale=True, disable=None if progress else True, leave=False
        )
        for r0, r1 in _chunks(n - 1, tile_r):
            if not first <= r0 < last:
                continue
            row_ops = ops.P[r0:r1]
            row_norm = norm[r0:r1]
            for c0 in range(r0, n, tile_c):
                c1 = min(c0 + tile_c, n)
                shape = (r1 - r0, c1 - c0)
                tile = buffers.get(shape)
                if tile is None:
                    tile = buffers[shape] = torch.empty(shape, dtype=torch.float32)
                t0 = time.perf_counter()
                torch.addmm(ops.bias[c0:c1].unsqueeze(0), row_ops, ops.Q[c0:c1].T, out=tile)
                t1 = time.perf_counter()
                # The reductions run in numpy, single-threaded: streaming over a cache-resident tile is
                # memory-bound, and short OpenMP regions stall whenever a core is busy elsewhere.
                values = tile.numpy()
                masked = 0
                if c0 == r0:  # the diagonal square: keep only j > i
                    side = r1 - r0
                    np.putmask(values[:, :side], tril[:side, :side], np.inf)
                    masked = side * (side + 1) // 2
                row_min, col_min = values.min(axis=1), values.min(axis=0)
                np.minimum(nn_sq[r0:r1], row_min, out=nn_sq[r0:r1])
                np.minimum(nn_sq[c0:c1], col_min, out=nn_sq[c0:c1])
                t2 = time.perf_counter()
                col_norm_max = float(norm[c0:c1].max())
                max_bound = max(max_bound, float(bounds.sq_error_bound(float(row_norm.max()), col_norm_max, terms)))
                valid = shape[0] * shape[1] - masked
                scanned = _exact_pass(x, values, valid, r0, c0, row_min, row_norm, col_norm_max, norm, best, terms)
                t3 = time.perf_counter()
                n_tiles += 1
                n_scanned += int(scanned)
                t_gemm += t1 - t0
                t_reduce += t2 - t1
                t_exact += t3 - t2
                bar.update(valid)
        bar.close()
    below = np.array([(i, j) for _, i, j in best.below], dtype=np.int64).reshape(-1, 2)
    return BlockSearch(
        n=n,
        d=d,
        rows=(first, last),
        k=k,
        threshold=threshold,
        tile_rows=tile_r,
        tile_cols=tile_c,
        n_pairs=n_pairs,
        i=best.i,
        j=best.j,
        d2=best.d2,
        n_below=best.n_below,
        below_i=below[:, 0],
        below_j=below[:, 1],
        below_d2=np.array([v for v, _, _ in best.below], dtype=np.float64),
        nn_sq=nn_sq[first:],
        n_tiles=n_tiles,
        n_tiles_scanned=n_scanned,
        n_exact=best.n_exact,
        seconds=time.perf_counter() - start,
        prepare_seconds=prepared - start,
        gemm_seconds=t_gemm,
        reduce_seconds=t_reduce,
        exact_seconds=t_exact,
        max_sq_error_bound=max_bound,
        mean_norm=float(ops.norm.mean()),
        max_norm=float(ops.norm.max()),
        offset_norm=ops.offset_norm,
    )


def _max_keep(k: int) -> int:
    return max(4 * k, 1024)


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
    best = _Best(k, threshold, max_keep=_max_keep(k))
    best.keep(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("i", "j", "d2")))
    best.n_below = sum(p.n_below for p in parts)
    best.n_exact = sum(p.n_exact for p in parts)
    listed = (zip(p.below_d2.tolist(), p.below_i.tolist(), p.below_j.tolist(), strict=True) for p in parts)
    best.below = [item for found in listed for item in found][:MAX_LISTED]  # in the order one pass finds them
    nn_sq = np.full(n, np.inf, dtype=np.float32)
    for p in parts:
        np.minimum(nn_sq[p.rows[0] :], p.nn_sq, out=nn_sq[p.rows[0] :])
    nn_distance, nn_exact = _nearest(nn_sq.astype(np.float64), best, n)
    closest = best.sorted_pairs()[:k]
    stats = SearchStats(
        n=n,
        d=one.d,
        n_pairs=n * (n - 1) // 2,
        tile_rows=one.tile_rows,
        tile_cols=one.tile_cols,
        n_tiles=sum(p.n_tiles for p in parts),
        n_tiles_scanned=sum(p.n_tiles_scanned for p in parts),
        n_exact=best.n_exact,
        seconds=sum(p.seconds for p in parts) + time.perf_counter() - start,
        prepare_seconds=sum(p.prepare_seconds for p in parts),
        gemm_seconds=sum(p.gemm_seconds for p in parts),
        reduce_seconds=sum(p.reduce_seconds for p in parts),
        exact_seconds=sum(p.exact_seconds for p in parts),
        max_sq_error_bound=max(p.max_sq_error_bound for p in parts),
        mean_norm=one.mean_norm,
        max_norm=one.max_norm,
        offset_norm=one.offset_norm,
        n_blocks=len(parts),
    )
    log.info(
        "%d vectors (d=%d): min %.6g, %d below %.3g; %.3g pairs/s, %d pairs re-measured in float64",
        n,
        one.d,
        closest[0].distance,
        best.n_below,
        threshold,
        stats.pairs_per_second,
        best.n_exact,
    )
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


def _exact_pass(
    x: ArrayLike,
    values: np.ndarray,
    valid: int,
    r0: int,
    c0: int,
    row_min: np.ndarray,
    row_norm: np.ndarray,
    col_norm_max: float,
    norm: np.ndarray,
    best: _Best,
    d: int,
) -> bool:
    """Re-measure in float64 every pair of the tile that could be among the k closest or under the threshold."""
    cutoff = best.cutoff
    if math.isinf(cutoff):  # fewer than k pairs known: measure this tile's k smallest to get a finite τ
        count = min(best.k, valid)  # the masked (lower-triangle) entries are +inf and sort last
        if count:
            flat = values.reshape(-1)
            idx = np.argpartition(flat, count - 1)[:count] if count < flat.size else np.arange(flat.size)
            i, j = r0 + idx // values.shape[1], c0 + idx % values.shape[1]
            cutoff = max(best.tau_with(exact_sq_distances(x, i, j)), best.thr_sq)
    row_cut = bounds.candidate_cutoff(cutoff, row_norm, col_norm_max, d)
    hit = np.flatnonzero(row_min <= row_cut)
    if hit.size == 0:
        return False
    sub = values[hit]
    ri, cj = np.nonzero((sub <= row_cut[hit, None]) & np.isfinite(sub))
    i = r0 + hit[ri]
    j = c0 + cj
    # a tighter, per-pair cutoff using both norms (the row cutoff used the tile's largest column norm)
    keep = sub[ri, cj] <= bounds.candidate_cutoff(cutoff, norm[i], norm[j], d)
    i, j = i[keep], j[keep]
    if len(i):
        best.add(i, j, exact_sq_distances(x, i, j))
    return True


def _nearest(nn_sq: np.ndarray, best: _Best, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-vector nearest-neighbour distance: exact where the pair was measured, else the GEMM value."""
    tau = best.tau
    exact = np.zeros(n, dtype=bool)
    exact_sq = np.full(n, math.inf)
    for a, b, v in zip(best.i, best.j, best.d2, strict=True):
        exact[a] = exact[b] = True
        exact_sq[a] = min(exact_sq[a], v)
        exact_sq[b] = min(exact_sq[b], v)
    # a vector in no kept pair has every pair above τ (or tied at τ): its exact NN is at least √τ
    approx = np.maximum(nn_sq, tau if math.isfinite(tau) else 0.0)
    value = np.where(exact, exact_sq, approx)
    return np.sqrt(np.maximum(value, 0.0)), exact
