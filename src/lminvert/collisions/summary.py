"""Distribution summaries of a search: nearest-neighbour quantiles and histogram, a sample of all-pair distances."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .operands import ArrayLike, exact_sq_distances

QUANTILES = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
BINS_PER_DECADE = 10


def quantiles(values: np.ndarray, levels: tuple[float, ...] = QUANTILES) -> dict[str, float]:
    """``{"0.01": q, ...}`` (linear interpolation between order statistics)."""
    points = np.quantile(np.asarray(values, dtype=np.float64), levels)
    return {f"{level:g}": float(point) for level, point in zip(levels, points, strict=True)}


def log_histogram(values: np.ndarray) -> dict[str, Any]:
    """Counts in log-spaced bins (``BINS_PER_DECADE`` per decade) of the positive values; zeros counted apart."""
    values = np.asarray(values, dtype=np.float64)
    positive = values[values > 0]
    zeros = int(np.count_nonzero(values == 0))
    if not len(positive):
        return {"edges": [], "counts": [], "zeros": zeros}
    lo = math.floor(math.log10(float(positive.min())))
    hi = max(lo + 1, math.ceil(math.log10(float(positive.max()))))
    edges = np.logspace(lo, hi, (hi - lo) * BINS_PER_DECADE + 1)
    counts, _ = np.histogram(positive, bins=edges)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts], "zeros": zeros}


def pair_sample(x: ArrayLike, size: int = 100_000, seed: int = 0) -> dict[str, Any]:
    """Quantiles of the exact distance of ``size`` pairs drawn uniformly (with replacement) among all pairs."""
    n = int(x.shape[0])
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, size=size)
    j = rng.integers(0, n - 1, size=size)
    j = np.where(j >= i, j + 1, j)  # uniform over j != i
    distance = np.sqrt(exact_sq_distances(x, i, j))
    return {"n": int(size), "seed": seed, "quantiles": quantiles(distance), "mean": float(distance.mean())}


def nn_spot_check(x: ArrayLike, nn_distance: np.ndarray, size: int = 256, seed: int = 0) -> dict[str, Any]:
    """Measure how far the reported NN distances are from float64 ones, on ``size`` random vectors.

    The reference is each sampled vector's nearest neighbour over all N, from a float64 GEMM on centred
    vectors (rounding ~1e-16 of the squared norms, far below the float32 errors being checked).
    """
    n = int(x.shape[0])
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(n, size=min(size, n), replace=False))
    mean = np.asarray(x).mean(axis=0, dtype=np.float64)
    sample = np.asarray(x[picks], dtype=np.float64) - mean
    sample_sq = np.einsum("ij,ij->i", sample, sample)
    best = np.full(len(picks), np.inf)
    for start in range(0, n, 16384):
        block = np.asarray(x[start : start + 16384], dtype=np.float64) - mean
        d2 = sample_sq[:, None] + np.einsum("ij,ij->i", block, block)[None, :] - 2.0 * (sample @ block.T)
        inside = (picks >= start) & (picks < start + len(block))
        d2[np.flatnonzero(inside), picks[inside] - start] = np.inf  # not the vector itself
        best = np.minimum(best, d2.min(axis=1))
    reference = np.sqrt(np.maximum(best, 0.0))
    error = np.abs(nn_distance[picks] - reference)
    return {
        "n": len(picks),
        "max_abs_error": float(error.max()),
        "max_rel_error": float((error / np.maximum(reference, 1e-300)).max()),
    }
