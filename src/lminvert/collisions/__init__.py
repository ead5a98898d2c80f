"""Injectivity at scale: exact minimum pairwise distances of hidden states, and the exhaustive next-token test.

* :func:`pairwise_min` - exact blocked search over N vectors (float32 GEMM, rigorous bound, float64 re-measure);
* :func:`find_collisions` - corpus -> prompts -> last-token states per layer -> search -> run directory;
* :func:`exhaustive_test` - every one-token continuation of a prefix, compared at each layer.

Both runs share :mod:`.runner`; :mod:`lminvert.report` renders their results.
"""

from __future__ import annotations

from .best import Pair
from .corpus_search import find_collisions
from .exhaustive import ExhaustiveResults, exhaustive_test, prefixes_from_collisions
from .operands import exact_sq_distances
from .results import ClosePair, CollisionConfig, CollisionResults, LayerResult
from .runner import SearchSettings
from .search import SearchResult, SearchStats, pairwise_min

__all__ = [
    "ClosePair",
    "CollisionConfig",
    "CollisionResults",
    "ExhaustiveResults",
    "LayerResult",
    "Pair",
    "SearchResult",
    "SearchSettings",
    "SearchStats",
    "exact_sq_distances",
    "exhaustive_test",
    "find_collisions",
    "pairwise_min",
    "prefixes_from_collisions",
]
