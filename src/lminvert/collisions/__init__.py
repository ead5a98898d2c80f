"""Injectivity at scale: exact minimum pairwise distances of hidden states, and the exhaustive next-token test.

* :func:`pairwise_min` - exact blocked search over N vectors (float32 GEMM, rigorous bound, float64 re-measure);
* :func:`find_collisions` - corpus -> prompts -> last-token states per layer -> search -> results files;
* :func:`exhaustive_test` - every one-token continuation of a prefix, compared at each layer;
* :func:`demo_run` - a small search for the demo.
"""

from __future__ import annotations

from .exhaustive import ExhaustiveResults, exhaustive_test
from .results import ClosePair, CollisionConfig, CollisionResults, LayerResult
from .run import CollisionDemo, demo_run, find_collisions
from .search import Pair, SearchResult, SearchStats, exact_sq_distances, pairwise_min

__all__ = [
    "ClosePair",
    "CollisionConfig",
    "CollisionDemo",
    "CollisionResults",
    "ExhaustiveResults",
    "LayerResult",
    "Pair",
    "SearchResult",
    "SearchStats",
    "demo_run",
    "exact_sq_distances",
    "exhaustive_test",
    "find_collisions",
    "pairwise_min",
]
