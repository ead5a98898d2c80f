"""Distribution summaries of a search: nearest-neighbour quantiles and histogram, a sample of all-pair distances."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .search import ArrayLike, exact_sq_distances

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
