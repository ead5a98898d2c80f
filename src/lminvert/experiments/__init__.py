"""The paper's experiments, each a small module of rows on the shared runner (:mod:`.runner`).

``lminvert experiment NAME [--quick] --out DIR`` runs one; :func:`run` is the same from Python.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LminvertError
from ..executors import Executor
from ..models import LoadedModel
from .base import Context, Experiment, FigureSpec, Series, Summary, Table, Unit
from .inversion import Depth, Noise, Splits
from .layers import Layers
from .methods import Methods
from .quantization import Quantization
from .runner import run_experiment
from .vocabulary import Vocabulary

EXPERIMENTS: dict[str, type[Experiment]] = {
    cls.name: cls for cls in [Methods, Depth, Vocabulary, Splits, Noise, Layers, Quantization]
}


def get_experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise LminvertError(f"unknown experiment '{name}': use one of {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]()


def run(
    name: str,
    out: str | Path,
    *,
    quick: bool = False,
    models: tuple[str, ...] | None = None,
    load: Callable[[str], LoadedModel] | None = None,
    seed: int = 0,
    progress: bool = True,
    executor: str | Executor | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run experiment ``name`` into ``out`` (resumed if it holds the same run) and write its report files.

    ``load`` turns model names into loaded models (default: ``lminvert.load_model`` in float32 on the CPU);
    ``overrides`` change single sizes (e.g. ``prompts=3``); ``executor`` runs the units (default: in this
    process; ``"ray"``, ``"ray:auto"``: on Ray workers). Returns the results document.
    """
    from ..models import load_model
    from ..report.experiments import render_experiment

    experiment = get_experiment(name)
    doc = run_experiment(
        experiment,
        load or load_model,
        out,
        quick=quick,
        models=models,
        seed=seed,
        overrides=overrides,
        progress=progress,
        executor=executor,
    )
    render_experiment(doc, out)
    return doc


__all__ = ["EXPERIMENTS", "Context", "Experiment", "FigureSpec", "Series", "Summary", "Table", "Unit"]
__all__ += ["get_experiment", "run", "run_experiment"]
