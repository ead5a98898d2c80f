"""``lminvert audit``: what leaks from a deployment (states, a KV cache, an embedding) at each layer, under each
defence, and what each defence costs; on the shared runner (:mod:`lminvert.experiments.runner`), resumable.

Parts: :mod:`.leaks` (what an attacker holds: the inversion's views, and what a defended leak costs the model's
output), :mod:`.defences` (one small class each), :mod:`.experiment` (units and rows: each cell's leak attacked by
:mod:`lminvert.invert.rows.attack`, the attack ``lminvert invert`` runs), :mod:`.summary` (the leak matrices and
verdict sentences).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LminvertError
from ..models import LoadedModel
from .defences import DEFAULT, DEFENCES, Defence, Shipped, parse_defence
from .experiment import Audit
from .leaks import LEAKS, Leak, make_leak

KIND = "audit"


def audit(
    out: str | Path,
    *,
    model: str | LoadedModel = "smollm2-135m",
    quick: bool = False,
    load: Callable[[str], LoadedModel] | None = None,
    seed: int = 0,
    progress: bool = True,
    **sizes: Any,
) -> dict[str, Any]:
    """Run the audit of ``model`` into ``out`` (resumed if it holds the same run) and write its report files.

    ``sizes`` change the preset (``quick`` or full): ``layers`` (e.g. ``[1, "middle", -1]``), ``leaks``
    (``states``, ``kv``, ``last``), ``defences`` (names as :func:`.defences.parse_defence` reads them), ``prompts``,
    ``length``, ``kinds``, ``prompts_file`` (one prompt a line), ``last_seconds`` (the ``last`` leak's search budget per
    prompt). ``model``: a name, or a model already loaded (used as it is). Returns the results document."""
    from ..experiments.runner import run_experiment
    from ..models import load_model
    from ..report.experiments import render_experiment

    if out is None:
        raise LminvertError("audit needs a directory to write into (out, --out)")
    if isinstance(model, LoadedModel):  # loaded already: the run records its name and uses it as it is
        model, load = model.name, (lambda _name, loaded=model: loaded)
    elif not isinstance(model, str):
        raise LminvertError(f"model must be a model's name or a loaded model, not {model!r:.60}")
    experiment = Audit()
    for name in sizes.get("defences") or ():
        parse_defence(name)
    seconds = sizes.get("last_seconds", 1)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
        raise LminvertError(f"last_seconds must be a positive number of seconds (got {seconds!r})")
    for name in sizes.get("leaks") or ():
        if name not in LEAKS:
            raise LminvertError(f"unknown leak '{name}': use {', '.join(LEAKS)}")
    doc = run_experiment(
        experiment, load or load_model, out, quick=quick, models=(model,), seed=seed, overrides=sizes,
        progress=progress, kind=KIND,
    )  # fmt: skip
    render_experiment(doc, out)
    return doc


__all__ = ["DEFAULT", "DEFENCES", "KIND", "LEAKS", "Audit", "Defence", "Leak", "Shipped", "audit", "make_leak"]
__all__ += ["parse_defence"]
