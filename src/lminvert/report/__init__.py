"""The report stage: every figure and every markdown renderer, from finished results.

:func:`render` writes a finished run's results.md and figures into its run directory; :func:`write_report` one
HTML (or markdown) page from several finished outputs. Nothing in the compute
stages (forward, inversion, collisions) draws or formats a report; nothing here computes a result.
"""

from __future__ import annotations

from typing import Any

from ..errors import LminvertError


def render(results: Any, figure: bool = True, directory: str | None = None) -> dict[str, str]:
    """Write results.md (and, unless ``figure`` is False, the figures) beside a run's results.json.

    Takes the results a run returned (:func:`lminvert.find_collisions`, :func:`lminvert.exhaustive_test`, or an
    experiment's results document with its ``directory``); returns the paths written.
    """
    from ..collisions import CollisionResults, ExhaustiveResults
    from .collisions import render_collisions, render_exhaustive

    if isinstance(results, dict) and results.get("kind") in ("experiment", "lab", "audit"):
        if directory is None:
            raise LminvertError("rendering an experiment's results needs its directory")
        from .experiments import render_experiment

        return render_experiment(results, directory, figure)

    if isinstance(results, CollisionResults):
        return render_collisions(results, figure)
    if isinstance(results, ExhaustiveResults):
        return render_exhaustive(results, figure)
    raise LminvertError(f"cannot render {type(results).__name__}: give collision or exhaustive results")


def write_report(paths: Any, out: Any, title: str = "lminvert report") -> Any:
    """One self-contained HTML page (``out`` ending in .html) or markdown page (.md) from several outputs."""
    from .html import write_report as html_page
    from .markdown_page import write_markdown

    return write_markdown(paths, out, title) if str(out).endswith(".md") else html_page(paths, out, title)


__all__ = ["render", "write_report"]
