"""Pairs whose inputs are identical (tokens with identical embedding rows) against pairs whose inputs differ.

Two continuations by tied tokens (see :mod:`lminvert.models.ties`) feed the model the same vectors: their
states are equal up to rounding, a collision by construction. The exhaustive test reports them apart, and
reports the closest pairs and the count under the threshold over the pairs whose inputs differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .operands import exact_sq_distances

MAX_TIED = 5000  # beyond this many tied pairs, the closest pairs with differing inputs are not tracked


def search_depth(k: int, tied: list[tuple[int, int]]) -> int:
    """How many closest pairs to search for so that the ``k`` closest with differing inputs are known exactly."""
    return k + len(tied) if len(tied) <= MAX_TIED else k


def tied_distances(x: np.ndarray, tied: list[tuple[int, int]]) -> np.ndarray:
    """Exact (float64) distances between the stored states of each tied pair (rows of ``x`` are token ids)."""
    if not tied:
        return np.empty(0)
    i, j = np.array(tied).T
    return np.sqrt(exact_sq_distances(x, i, j))


def tied_summary(distance: np.ndarray, groups: list[list[int]], threshold: float) -> dict:
    """The tied pairs (identical inputs), from their :func:`tied_distances`: how many under the threshold."""
    if not len(distance):
        return {"groups": [], "n_pairs": 0}
    return {
        "groups": groups,
        "n_pairs": len(distance),
        "n_below_threshold": int(np.count_nonzero(distance < threshold)),
        "max_distance": float(distance.max()),
    }


def differing_summary(
    summary: dict[str, Any], tied: list[tuple[int, int]], distance: np.ndarray, k: int, threshold: float
) -> dict[str, Any]:
    """The ``k`` closest pairs whose inputs differ, and the count of such pairs under the threshold
    (``distance``: the tied pairs' :func:`tied_distances`).

    Exact only when the search went :func:`search_depth` deep; otherwise the closest pairs are not tracked.
    """
    complete = len(tied) <= MAX_TIED
    tied_set = set(tied)
    rows = [(int(i), int(j), float(d)) for i, j, d in summary["closest"] if (int(i), int(j)) not in tied_set]
    tied_below = int(np.count_nonzero(distance < threshold))
    return {
        "min_distance": rows[0][2] if rows and complete else None,
        "closest_pairs": [{"a_token": i, "b_token": j, "distance": d} for i, j, d in rows[:k]] if complete else [],
        "n_below_threshold": int(summary["n_below_threshold"]) - tied_below,
    }
