"""Pairs whose inputs are identical (tokens with identical embedding rows) against pairs whose inputs differ.

Two continuations by tied tokens (see :mod:`lminvert.models.ties`) feed the model the same vectors: their
states are equal up to rounding, a collision by construction. The exhaustive test reports them apart, and
reports the closest pairs and the count under the threshold over the pairs whose inputs differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .search import exact_sq_distances

MAX_TIED = 5000  # beyond this many tied pairs, the closest pairs with differing inputs are not tracked


def search_depth(k: int, tied: list[tuple[int, int]]) -> int:
    """How many closest pairs to search for so that the ``k`` closest with differing inputs are known exactly."""
    return k + len(tied) if len(tied) <= MAX_TIED else k


def tied_summary(x: np.ndarray, groups: list[list[int]], tied: list[tuple[int, int]], threshold: float) -> dict:
    """Exact distances between continuations by tokens with identical embedding rows (identical inputs)."""
    if not tied:
        return {"groups": [], "n_pairs": 0}
    i, j = np.array(tied).T
    distance = np.sqrt(exact_sq_distances(x, i, j))
    return {
        "groups": groups,
        "n_pairs": len(tied),
        "n_below_threshold": int(np.count_nonzero(distance < threshold)),
        "max_distance": float(distance.max()),
    }


def differing_summary(
    summary: dict[str, Any], tied: list[tuple[int, int]], k: int, threshold: float, x: np.ndarray
) -> dict[str, Any]:
    """The ``k`` closest pairs whose inputs differ, and the count of such pairs under the threshold.

    Exact only when the search went :func:`search_depth` deep; otherwise the closest pairs are not tracked.
    """
    complete = len(tied) <= MAX_TIED
    tied_set = set(tied)
    rows = [(int(i), int(j), float(d)) for i, j, d in summary["closest"] if (int(i), int(j)) not in tied_set]
    tied_below = 0
    if tied:
        i, j = np.array(tied).T
        tied_below = int(np.count_nonzero(np.sqrt(exact_sq_distances(x, i, j)) < threshold))
    return {
        "min_distance": rows[0][2] if rows and complete else None,
        "closest_pairs": [{"a_token": i, "b_token": j, "distance": d} for i, j, d in rows[:k]] if complete else [],
        "n_below_threshold": int(summary["n_below_threshold"]) - tied_below,
    }
