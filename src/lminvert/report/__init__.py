"""The report stage: every figure and every markdown renderer, from finished results.

:func:`render` writes a finished run's results.md and figures into its run directory. Nothing in the compute
stages (forward, inversion, collisions) draws or formats a report; nothing here computes a result.
"""

from __future__ import annotations

from typing import Any

from ..errors import LminvertError


def render(results: Any, figure: bool = True) -> dict[str, str]:
    """Write results.md (and, unless ``figure`` is False, the figures) beside a run's results.json.

    Takes the results a run returned (:func:`lminvert.find_collisions`, :func:`lminvert.exhaustive_test`);
    returns ``{"markdown": path, "figure": path}``.
    """
    from ..collisions import CollisionResults, ExhaustiveResults
    from .collisions import render_collisions, render_exhaustive

    if isinstance(results, CollisionResults):
        return render_collisions(results, figure)
    if isinstance(results, ExhaustiveResults):
        return render_exhaustive(results, figure)
    raise LminvertError(f"cannot render {type(results).__name__}: give collision or exhaustive results")


__all__ = ["render"]
