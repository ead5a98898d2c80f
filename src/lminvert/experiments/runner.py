"""The one runner every experiment (and the injectivity lab) goes through.

Run directory::

    manifest.json        kind ``experiment``, the experiment's name, sizes, seed and models (a resumed run must match)
    units/<key>.json     one finished unit: its rows and seconds (a resumed run skips it)
    results.json         config, machine, versions, every row, the summary (tables + figure specs), timings
    results.md, figures/ written by :func:`lminvert.report.render` from results.json

An interrupted run (Ctrl-C, a killed process) resumes from its directory: finished units are read back, the rest
are computed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import LminvertError
from ..models import LoadedModel
from ..paths import check_output_dir
from ..runs import RunDirectory, run_metadata, versions
from .base import Context, Experiment

log = logging.getLogger(__name__)

KIND = "experiment"


def _unit_file(key: str) -> str:
    if not key or any(c in key for c in "/\\ ") or key.startswith("."):
        raise ValueError(f"unit key {key!r} is not a plain file name")
    return f"units/{key}.json"


def run_experiment(
    experiment: Experiment,
    load: Callable[[str], LoadedModel],
    out: str | Path,
    *,
    quick: bool = False,
    models: tuple[str, ...] | None = None,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    progress: bool = True,
    kind: str = KIND,
) -> dict[str, Any]:
    """Run ``experiment`` into ``out`` (created or resumed) and return its results document.

    ``load(name)`` turns a model name into a :class:`LoadedModel` (the CLI passes ``lminvert.load_model`` with
    the user's dtype and device); each model is loaded at most once per run.
    """
    out = check_output_dir(out)
    size = experiment.size(quick, overrides)
    models = tuple(models or (experiment.quick_models if quick else None) or experiment.models)
    config = {"experiment": experiment.name, "quick": quick, "seed": seed, "size": size, "models": list(models)}
    config = json.loads(json.dumps(config))  # as a resumed run reads it back (tuples become lists)
    run = RunDirectory(out, kind, config, identity=["experiment", "quick", "seed", "size", "models"])
    loaded: dict[str, LoadedModel] = {}

    def load_once(name: str) -> LoadedModel:
        if name not in loaded:
            loaded[name] = load(name)
        return loaded[name]

    ctx = Context(experiment.name, quick, seed, size, models, run.path, load_once)
    start = time.perf_counter()
    units = experiment.units(ctx)
    keys = [u.key for u in units]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{experiment.name}: unit keys are not unique")
    rows: list[dict[str, Any]] = []
    unit_seconds: dict[str, float] = {}
    resumed = 0
    bar = tqdm(units, desc=experiment.name, unit="unit", disable=not progress, leave=False)
    for unit in bar:
        bar.set_postfix_str(unit.label[:40])
        path = run / _unit_file(unit.key)
        if path.exists():
            resumed += 1

        def compute(unit=unit) -> dict[str, Any]:
            began = time.perf_counter()
            produced = experiment.run_unit(ctx, unit)
            return {"unit": unit.key, "seconds": time.perf_counter() - began, "rows": produced}

        done = run.step(_unit_file(unit.key), compute)
        unit_seconds[unit.key] = done["seconds"]
        rows.extend({"unit": unit.key, **row} for row in done["rows"])
    bar.close()
    if not rows:
        raise LminvertError(f"experiment {experiment.name} produced no rows (is the size too small?)")
    summary = experiment.summarise(ctx, rows)
    main = loaded.get(models[0]) if models else None
    doc = {
        "kind": kind,
        "experiment": experiment.name,
        "title": experiment.title,
        "paper": experiment.paper,
        "config": config,
        "full_duration": experiment.full_duration,
        "overrides": {k: v for k, v in (overrides or {}).items() if v is not None},
        "seconds": time.perf_counter() - start,
        "units_seconds": unit_seconds,
        "units_resumed": resumed,
        "compute_seconds": sum(unit_seconds.values()),
        **run_metadata(main.describe() if main is not None else {}, seed),
        "versions": versions(),
        "models_info": {name: m.describe() for name, m in loaded.items()},
        "summary": asdict(summary),
        "rows": rows,
    }
    run.write_results(doc)
    log.info("%s: %d units (%d resumed) in %.1f s -> %s", experiment.name, len(units), resumed, doc["seconds"], out)
    return doc
