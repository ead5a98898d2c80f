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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import LminvertError, check_kind
from ..executors import Executor, get_executor
from ..models import LoadedModel
from ..paths import check_output_dir, read_json
from ..runs import RunDirectory, run_metadata
from .base import Context, Experiment, Unit

log = logging.getLogger(__name__)

KIND = "experiment"


def _unit_file(key: str) -> str:
    if not key or any(c in key for c in "/\\ ") or key.startswith("."):
        raise ValueError(f"unit key {key!r} is not a plain file name")
    return f"units/{key}.json"


@dataclass(frozen=True)
class _UnitSetup:
    """A worker's context for the units: the run's own in this process, a copy with its own models elsewhere."""

    experiment: Experiment
    ctx: Context
    load: Callable[[str], LoadedModel]

    @property
    def key(self) -> str:
        return f"experiment:{self.experiment.name}:{self.ctx.directory}"

    def here(self) -> tuple[Experiment, Context, dict[str, LoadedModel]]:
        return self.experiment, self.ctx, {}

    def make(self) -> tuple[Experiment, Context, dict[str, LoadedModel]]:
        loaded: dict[str, LoadedModel] = {}

        def load_once(name: str) -> LoadedModel:
            if name not in loaded:
                loaded[name] = self.load(name)
            return loaded[name]

        ctx = self.ctx
        copy = Context(ctx.name, ctx.quick, ctx.seed, ctx.size, ctx.models, ctx.directory, load_once)
        return self.experiment, copy, loaded

    def __getstate__(self) -> dict[str, Any]:
        ctx = self.ctx  # without the models this process loaded and the values its units shared
        plain = Context(ctx.name, ctx.quick, ctx.seed, ctx.size, ctx.models, ctx.directory, _unset)
        return {**self.__dict__, "ctx": plain}


def _unset(name: str) -> LoadedModel:
    raise RuntimeError("a shipped context loads models through its setup")


def _run_unit(
    state: tuple[Experiment, Context, dict[str, LoadedModel]], unit: Unit
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One unit's rows and seconds, and the models a worker loaded for it (described)."""
    experiment, ctx, loaded = state
    began = time.perf_counter()
    produced = experiment.run_unit(ctx, unit)
    done = {"unit": unit.key, "seconds": time.perf_counter() - began, "rows": produced}
    return done, {name: m.describe() for name, m in loaded.items()}


def _check_size(name: str, value: Any, default: Any) -> None:
    """A one-line error for a size given with another kind than its preset's (``--size length=abc`` where an int goes;
    a float for an int; a string where a list goes), before any work. A preset of None takes anything."""
    kinds = [(bool, "flag"), (int, "int"), (float, "number"), (str, "text"), (list, "list"), (dict, "mapping")]
    kind = next((kind for preset, kind in kinds if isinstance(default, preset)), None)
    if kind is not None:
        check_kind(f"--size {name}", value, kind, f" (the preset's is {default!r})")


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
    executor: str | Executor | None = None,
) -> dict[str, Any]:
    """Run ``experiment`` into ``out`` (created or resumed) and return its results document.

    ``load(name)`` turns a model name into a :class:`LoadedModel` (the CLI passes ``lminvert.load_model`` with
    the user's dtype and device); each model is loaded at most once per run (per worker where ``executor``
    sends the units to other processes; ``load`` must then be picklable). Each unit is kept as it finishes.
    A size ``overrides`` names that the experiment does not have is refused in one line before any work.
    """
    unknown = set(overrides or {}) - set(experiment.full_size)
    if unknown:
        what = experiment.name if kind == experiment.name else f"{kind} {experiment.name}"
        raise LminvertError(f"{what} has no size {', '.join(sorted(unknown))}: use {', '.join(experiment.full_size)}")
    for name, value in (overrides or {}).items():
        _check_size(name, value, experiment.full_size[name])
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
    infos, resumed = _run_units(experiment, ctx, load, run, units, progress, executor)
    rows: list[dict[str, Any]] = []
    unit_seconds: dict[str, float] = {}
    for unit in units:
        done = read_json(run / _unit_file(unit.key))
        unit_seconds[unit.key] = done["seconds"]
        rows.extend({"unit": unit.key, **row} for row in done["rows"])
    if not rows:
        raise LminvertError(f"experiment {experiment.name} produced no rows (is the size too small?)")
    infos.update({name: m.describe() for name, m in loaded.items()})
    doc = _document(experiment, ctx, kind, config, overrides, rows, unit_seconds, resumed, infos, start)
    run.write_results(doc)
    log.info("%s: %d units (%d resumed) in %.1f s -> %s", experiment.name, len(units), resumed, doc["seconds"], out)
    return doc


def _run_units(
    experiment: Experiment,
    ctx: Context,
    load: Callable[[str], LoadedModel],
    run: RunDirectory,
    units: list[Unit],
    progress: bool,
    executor: str | Executor | None,
) -> tuple[dict[str, dict[str, Any]], int]:
    """Run the units not kept in ``run`` yet, keeping each as it finishes; returns what the workers loaded (models
    loaded in other processes, described) and how many units were resumed."""
    todo = [unit for unit in units if not (run / _unit_file(unit.key)).exists()]
    resumed = len(units) - len(todo)
    infos: dict[str, dict[str, Any]] = {}
    bar = tqdm(
        total=len(units), initial=resumed, desc=experiment.name, unit="unit", disable=None if progress else True,
        leave=False,
    )  # fmt: skip
    setup = _UnitSetup(experiment, ctx, load)
    for index, (done, described) in get_executor(executor).map_with(setup, _run_unit, todo):
        run.step(_unit_file(todo[index].key), lambda done=done: done)
        infos.update(described)
        bar.set_postfix_str(todo[index].label[:40])
        bar.update(1)
    bar.close()
    return infos, resumed


def _document(
    experiment: Experiment,
    ctx: Context,
    kind: str,
    config: dict[str, Any],
    overrides: Mapping[str, Any] | None,
    rows: list[dict[str, Any]],
    unit_seconds: dict[str, float],
    resumed: int,
    infos: dict[str, dict[str, Any]],
    start: float,
) -> dict[str, Any]:
    """The results document: the run's identity, its rows, their summary, and what ran them (``start``: when the
    run began, on ``time.perf_counter``)."""
    main = infos.get(ctx.models[0], {}) if ctx.models else {}
    summary = asdict(experiment.summarise(ctx, rows))
    return {
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
        **run_metadata(main, ctx.seed),  # with the versions
        "models_info": infos,
        "summary": summary,
        "rows": rows,
    }
