"""The exactly measured pairs of a search (:mod:`.search`): which can still be among the k closest (τ), which fall
under the threshold, each tile's re-measurement in float64 of every pair its rounding bound cannot rule out, and the
nearest-neighbour distances they give."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import bounds
from .operands import ArrayLike, exact_sq_distances

MAX_LISTED = 10_000  # pairs under the threshold listed individually (all are counted)


@dataclass(frozen=True)
class Pair:
    """Two vectors (indices ``i < j``) and their exact float64 distance."""

    i: int
    j: int
    distance: float


def max_keep(k: int) -> int:
    """Measured pairs a search keeps at most when many tie at τ."""
    return max(4 * k, 1024)


class Best:
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
        self.listed = MAX_LISTED  # (read when made: a test lowers it)

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
        room = self.listed - len(self.below)
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


def exact_pass(
    x: ArrayLike,
    values: np.ndarray,
    valid: int,
    r0: int,
    c0: int,
    row_min: np.ndarray,
    row_norm: np.ndarray,
    col_norm_max: float,
    norm: np.ndarray,
    best: Best,
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


def nearest(nn_sq: np.ndarray, best: Best, n: int) -> tuple[np.ndarray, np.ndarray]:
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
