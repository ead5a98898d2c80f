"""Measurements several experiments share: one prompt encoded at a layer and inverted, as a row."""

from __future__ import annotations

from collections.abc import Sequence

from ..forward import encode
from ..invert import InversionResult, invert
from ..models import Layer, LoadedModel
from .base import Row


def score(truth: Sequence[int], found: Sequence[int], uncertain: Sequence[int] = ()) -> Row:
    """Exactness of one recovered prompt; ``wrong_unflagged``: positions wrong but not marked uncertain."""
    right = [a == b for a, b in zip(truth, found, strict=False)] + [False] * (len(truth) - len(found))
    flagged = set(uncertain)
    return {
        "exact": all(right) and len(found) == len(truth),
        "token_accuracy": sum(right) / len(truth),
        "wrong_unflagged": sum(1 for i, ok in enumerate(right[: len(found)]) if not ok and i not in flagged),
    }


def result_row(ids: Sequence[int], r: InversionResult) -> Row:
    """One inverted prompt as a row: its score against ``ids``, time, candidates and time split."""
    split = r.time_split
    return {
        **score(ids, r.token_ids, r.uncertain_positions),
        "layer": r.layer,
        "length": len(ids),
        "seconds": r.seconds,
        "candidates_per_position": sum(r.candidates_checked) / len(ids),
        "max_candidates": max(r.candidates_checked),
        "explored": r.explored_fraction,
        "vocab_size": r.vocab_size,
        "uncertain": len(r.uncertain_positions),
        **r.verdict_counts,
        "complete": True,
        "ranking_seconds": split["ranking"],
        "verification_seconds": split["verification"],
    }


def inversion_row(
    model: LoadedModel,
    ids: Sequence[int],
    layer: Layer | int | str,
    *,
    method: str = "sipit",
    policy: str = "linear",
    noise: float = 0.0,
    seed: int = 0,
    max_candidates: int | None = None,
) -> Row:
    """Encode ``ids`` at ``layer``, invert them, and score the result against ``ids``."""
    layer = model.probe.layer(layer)
    states = encode(model, [list(ids)], layer)
    (r,) = invert(model, states, method=method, policy=policy, noise=noise, seed=seed, max_candidates=max_candidates)
    row = result_row(ids, r)
    if noise > 0:
        row["positions"] = [
            {
                "correct": p.token_id == t,
                "uncertain": p.uncertain,
                "noise_norm": p.noise_norm,
                "certified_radius": p.certified_radius,
                "whole_vocabulary": p.whole_vocabulary,
            }
            for p, t in zip(r.positions, ids, strict=True)
        ]
    return row
