"""What an experiment is: a small class that declares its sizes, splits its work into units and turns rows into
tables and figure specifications. The shared runner (:mod:`lminvert.experiments.runner`) does everything else:
the run directory, resuming, progress, timings, results.json; :mod:`lminvert.report` draws and formats.

An experiment calls the public API only (``lminvert.invert``, ``lminvert.encode``, ``lminvert.find_collisions``,
...). Its rows are plain JSON records, one per measured thing (a prompt inverted by one method, a layer's
minimum distance, ...): everything a table or figure shows is computed from them, so a reader can recompute it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..models import LoadedModel

Row = dict[str, Any]
THRESHOLD = 1e-6  # the paper's collision threshold (L2)


@dataclass(frozen=True)
class Unit:
    """One resumable piece of work: its rows are kept in ``units/<key>.json`` once finished."""

    key: str  # unique within the run, file-name safe
    label: str  # what the progress bar shows
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Table:
    """A table for results.md and the HTML report. ``note``: how ours differs from the paper's, and why."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    note: str = ""


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float | str]
    y: Sequence[float]
    yerr: Sequence[float] | None = None


@dataclass(frozen=True)
class FigureSpec:
    """A figure as data; :mod:`lminvert.report.figures` draws it. ``caption``: one sentence on what to look at.

    ``kind``: ``line`` (x numeric), ``bar`` (x categories) or ``file`` (an image another run already drew,
    ``path`` relative to the run directory).
    """

    name: str
    caption: str
    kind: str = "line"
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    series: Sequence[Series] = ()
    logx: bool = False
    logy: bool = False
    hline: float | None = None
    hline_label: str = ""
    path: str | None = None


def minima_figure(name: str, caption: str, title: str, xlabel: str, series: Sequence[Series]) -> FigureSpec:
    """Minimum pairwise distances against ``xlabel`` (log scale) with the paper's collision threshold drawn."""
    return FigureSpec(
        name,
        caption,
        title=title,
        xlabel=xlabel,
        ylabel="minimum L2 distance",
        series=series,
        logy=True,
        hline=THRESHOLD,
        hline_label="collision threshold 1e-6",
    )


@dataclass(frozen=True)
class Summary:
    tables: Sequence[Table] = ()
    figures: Sequence[FigureSpec] = ()
    notes: Sequence[str] = ()


@dataclass
class Context:
    """What a unit sees: the sizes, the seed, the models (loaded once per run), the run directory."""

    name: str
    quick: bool
    seed: int
    size: Mapping[str, Any]
    models: Sequence[str]
    directory: Path
    load: Callable[[str], LoadedModel]
    memo: dict[Any, Any] = field(default_factory=dict)  # per-run values several units share (prompt sets, ...)

    def once(self, key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


class Experiment:
    """Subclasses set the class attributes and implement :meth:`units`, :meth:`run_unit` and :meth:`summarise`."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    paper: ClassVar[str] = ""  # what the paper reported, in one paragraph
    models: ClassVar[tuple[str, ...]] = ("smollm2-135m",)
    quick_models: ClassVar[tuple[str, ...] | None] = None  # the models of the quick size (default: ``models``)
    quick_size: ClassVar[Mapping[str, Any]] = {}
    full_size: ClassVar[Mapping[str, Any]] = {}
    full_duration: ClassVar[str] = ""  # expected duration of the full size on the reference 2-core CPU

    def size(self, quick: bool, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        size = dict(self.quick_size if quick else self.full_size)
        size.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return size

    def units(self, ctx: Context) -> list[Unit]:
        raise NotImplementedError

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        raise NotImplementedError

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        raise NotImplementedError


# Small statistics shared by the experiments' summaries.


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = [float(v) for v in values]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def rate_se(hits: int, n: int) -> tuple[float, float]:
    """A proportion and its standard error (binomial)."""
    if n == 0:
        return math.nan, math.nan
    p = hits / n
    return p, math.sqrt(p * (1 - p) / n)


def group(rows: Sequence[Row], *keys: str) -> dict[tuple, list[Row]]:
    """Rows grouped by the values of ``keys``, in first-seen order."""
    out: dict[tuple, list[Row]] = {}
    for row in rows:
        out.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    return out
