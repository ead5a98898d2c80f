"""The injectivity lab: injectivity at initialisation (``init``), through training (``train``) and where it
breaks (``break``), each an experiment on the shared runner (:mod:`lminvert.experiments.runner`), kind ``lab``.

``lminvert lab NAME [--quick] --out DIR`` runs one; :func:`run` is the same from Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import LminvertError
from ..experiments.base import Experiment
from ..experiments.runner import run_experiment
from .breaks import Break
from .init import Init
from .train import Train

LABS: dict[str, type[Experiment]] = {cls.name: cls for cls in [Init, Train, Break]}


def get_lab(name: str) -> Experiment:
    if name not in LABS:
        raise LminvertError(f"unknown lab '{name}': use one of {', '.join(LABS)}")
    return LABS[name]()


def run(
    name: str,
    out: str | Path,
    *,
    quick: bool = False,
    seed: int = 0,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Run lab ``name`` into ``out`` (resumed if it holds the same run) and write its report files.

    The labs build their own models (random initialisations, a model trained here, constructions); ``overrides``
    change single sizes (e.g. ``seeds=2``). Returns the results document.
    """
    from ..models import load_model
    from ..report.experiments import render_experiment

    lab = get_lab(name)
    doc = run_experiment(
        lab, load_model, out, quick=quick, seed=seed, overrides=overrides, progress=progress, kind="lab"
    )
    render_experiment(doc, out)
    return doc


__all__ = ["LABS", "get_lab", "run"]
