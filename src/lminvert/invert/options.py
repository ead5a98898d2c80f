""":func:`lminvert.invert`'s options in the three groups ``lminvert invert`` shows them in: what the leak is
(:class:`Leak`), how to search it (:class:`Search`), where to run (:class:`Run`). Each field is named as the command's
option (``max_seconds`` is ``--max-seconds``); each group checks itself when it is made, so a bad option is a one-line
error before anything is loaded or computed.

A call gives a group whole (``search=Search(max_seconds=30)``) or any of its fields by name
(``max_seconds=30``): :func:`grouped` puts each name in its group, and refuses a name that is no option or is given
both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import LminvertError, check_kind
from ..executors import Executor
from .policies import POLICIES
from .sources import ErrorModel, parse_source
from .views import VIEWS

METHODS = ("sipit", "bruteforce")
# each option's kind (:func:`lminvert.errors.check_kind`), checked before its value (a string or a None where a number
# goes was a TypeError deep inside); None only for the OPTIONAL ones
KIND = {
    **dict.fromkeys(("max_candidates", "seed", "max_length", "together", "batch_scale"), "int"),
    **dict.fromkeys(("noise", "max_seconds", "tolerance_scale"), "number"),
    **dict.fromkeys(
        ("check", "normalised", "certify", "screen", "speculate", "scout", "first_table", "progress"), "flag"
    ),
    **dict.fromkeys(("kind", "method", "policy"), "text"),
}
OPTIONAL = frozenset({"max_candidates", "max_seconds", "certify", "screen", "scout", "max_length", "batch_scale"})


def _check_types(group: object) -> None:
    """A one-line error for an option of ``group`` (a frozen dataclass of this module) given a value of another kind
    than :data:`KIND` names (None only where :data:`OPTIONAL` allows it)."""
    for option in fields(group):  # type: ignore[arg-type]
        name, value = option.name, getattr(group, option.name)
        if name in KIND and not (value is None and name in OPTIONAL):
            check_kind(name, value, KIND[name])


@dataclass(frozen=True)
class Leak:
    """What the leak is (the layer, a KV cache's block, is :func:`lminvert.invert`'s third argument).

    ``kind`` (``--leak``): ``states`` (every position's state), ``kv`` (a block's KV cache) or ``last`` (the last
    position's state). ``source`` (``--source``): the states' error model, as a name or an
    :class:`~lminvert.invert.sources.ErrorModel` (``None``: what the states say). ``noise`` (``--noise``): relative
    Gaussian noise added here, for robustness studies (modelled, so not with ``source``). ``check`` (``--check``): score
    a bare array against every layer first. ``normalised`` (``--normalised``, ``last`` only): the vector was scaled to
    unit length, as embedding APIs return it (directions are compared)."""

    kind: str = "states"
    source: str | ErrorModel | None = None
    noise: float = 0.0
    check: bool = True
    normalised: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.kind not in VIEWS:
            raise LminvertError(f"unknown leak '{self.kind}': use one of {', '.join(VIEWS)}")
        if self.noise < 0 or self.noise != self.noise:
            raise LminvertError("noise (--noise) must be a non-negative number (a relative level, e.g. 0.001)")
        if self.source is not None and self.noise > 0:
            raise LminvertError(
                "give either noise (--noise: added here, and modelled) or source (--source: what the states carry), "
                "not both"
            )
        if isinstance(self.source, str):
            parse_source(self.source)  # a bad name fails here
        elif self.source is not None and not isinstance(self.source, ErrorModel):
            raise LminvertError(f"source must be a name like 'float' or 'noise:0.01', not {self.source!r:.60}")
        if self.normalised and self.kind != "last":
            raise LminvertError("normalised (--normalised) describes one vector: give it with --leak last")


@dataclass(frozen=True)
class Search:
    """How to search: options that change how far the search goes, never what the acceptor accepts.

    ``method``: ``sipit`` (policy-guided) or ``bruteforce`` (the whole vocabulary: the oracle). ``policy``: sipit's
    candidate order. ``max_candidates`` / ``max_seconds``: budgets (per position / from the call, one-time builds not
    counted). ``tolerance_scale``: multiplies the measured acceptance radii. ``certify``: verify the whole vocabulary at
    every position (``None``: where the model has forward hooks). ``screen``: bfloat16 screening of a float32 model's
    batches (``None``: where it pays). ``speculate``: verify the next positions' first guesses in the same forward.
    ``scout``: guess the whole prompt first by a search in bfloat16 GEMMs, checked by one plain forward (``None``: where
    it pays). ``first_table``: rank position 0 with the first-position table. ``seed``: of the random orders and of
    ``noise``. ``max_length`` (``--max-length``, a ``last`` leak only): the longest prompt tried (default 8); there
    ``max_seconds`` bounds each vector's search (default 60)."""

    method: str = "sipit"
    policy: str = "linear"
    max_candidates: int | None = None
    max_seconds: float | None = None
    tolerance_scale: float = 1.0
    certify: bool | None = None
    screen: bool | None = None
    speculate: bool = True
    scout: bool | None = None
    first_table: bool = True
    seed: int = 0
    max_length: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_length is not None and self.max_length < 1:
            raise LminvertError("max_length (--max-length) must be at least 1 (tokens)")
        if self.method not in METHODS:
            raise LminvertError(f"unknown method '{self.method}': use one of {', '.join(METHODS)}")
        if self.policy not in POLICIES:
            raise LminvertError(f"unknown policy '{self.policy}': use one of {', '.join(POLICIES)}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise LminvertError("max_seconds (--max-seconds) must be a positive number of seconds")
        if not self.tolerance_scale > 0:
            raise LminvertError("tolerance_scale (--tolerance-scale) must be positive (1 = the measured radii)")
        if self.max_candidates is not None and self.max_candidates < 1:
            raise LminvertError("max_candidates (--max-candidates) must be at least 1")


@dataclass(frozen=True)
class Run:
    """Where and how the search runs; none of it changes an answer.

    ``together`` (``--together``): prompts inverted at once, sharing each verification forward. ``executor``
    (``--ray``): where chunks of ``together`` prompts run (:func:`lminvert.executors.get_executor`). ``batch_scale``:
    candidate batches this many times a CPU's (``None``: by device). ``progress``: a progress bar."""

    together: int = 32
    executor: str | Executor | None = None
    batch_scale: int | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.executor is not None and not (isinstance(self.executor, str) or hasattr(self.executor, "map_with")):
            raise LminvertError(f"executor must be a name like 'ray:auto' or an Executor, not {self.executor!r:.60}")
        if self.together < 1:
            raise LminvertError("together (--together) must be at least 1 (prompts inverted at once)")
        if self.batch_scale is not None and self.batch_scale < 1:
            raise LminvertError("batch_scale must be at least 1 (candidate batches relative to a CPU's)")


GROUPS = {"leak": Leak, "search": Search, "run": Run}
_OPTION = {f.name: name for name, group in GROUPS.items() for f in fields(group)}  # option -> its group


def grouped(
    leak: Leak | str | None = None, search: Search | None = None, run: Run | None = None, **options: Any
) -> tuple[Leak, Search, Run]:
    """The three groups of a call: each given group, with every option given by name put into its own; ``leak`` may
    be a leak's kind (``"kv"``), with the leak's other options by name beside it (``leak="kv", source="float"``).
    One-line errors for an unknown option, an option given in a group and by name, and the engine's options asked of
    a leak that the rows search inverts."""
    if isinstance(leak, str):  # the kind alone, as a name: the leak's other options may come by name beside it
        if "kind" in options:
            raise LminvertError(f"the leak's kind given twice (leak={leak!r} and kind=): give it once")
        leak, options = None, {"kind": leak, **options}
    made = {"leak": leak, "search": search, "run": run}
    for name, group in GROUPS.items():
        if made[name] is not None and not isinstance(made[name], group):
            kind = "a leak's kind ('kv'), " if name == "leak" else ""
            raise LminvertError(
                f"{name}= takes {kind}lminvert.{group.__name__}(...) or None, not {made[name]!r:.60} (or give its "
                "options by name)"
            )
    loose: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
    for option, value in options.items():
        if option not in _OPTION:
            known = ", ".join(sorted(_OPTION))
            raise LminvertError(f"invert() takes no option '{option}': use one of {known}, or leak=, search=, run=")
        loose[_OPTION[option]][option] = value
    for name, group in GROUPS.items():
        if made[name] is not None and loose[name]:
            twice = ", ".join(loose[name])
            raise LminvertError(f"{twice} given both by name and in {name}=: give each option once")
        made[name] = replace(made[name], **loose[name]) if made[name] is not None else group(**loose[name])
    groups = (made["leak"], made["search"], made["run"])
    check_rows_options(*groups)
    return groups


def check_rows_options(leak: Leak, search: Search, run: Run, defended: str | None = None) -> None:
    """A one-line error for the engine's options given with a leak that the rows search inverts (``kv``, ``last``,
    states under ``defended``, a noise or quantisation source's label: known once the states are read), which it does
    not take (``together`` other than 1 and its default among them: it inverts one prompt at a time); ``max_seconds`` it
    takes (each position after the bound stops after its first batch; one vector's search is bounded by it)."""
    if leak.kind != "last" and search.max_length is not None:
        raise LminvertError("max_length (--max-length) is for one vector: use it with --leak last")
    if leak.kind == "states" and defended is None:
        return
    given = {
        "--method": search.method != Search.method, "--policy": search.policy != Search.policy,
        "--noise": leak.noise > 0, "--max-candidates": search.max_candidates is not None,
        "--certify": bool(search.certify), "--ray": run.executor not in (None, "inprocess"),
        "--tolerance-scale": search.tolerance_scale != 1.0, "--scout/--no-scout": search.scout is not None,
        "--no-speculate": not search.speculate, "first_table": not search.first_table, "--seed": search.seed != 0,
        "--screen/--no-screen": leak.kind == "last" and search.screen is not None,
        # one prompt at a time, each batch its own size: --together 1 is what it does
        "--together": run.together not in (1, Run.together), "batch_scale": run.batch_scale is not None,
    }  # fmt: skip
    refused = [name for name, on in given.items() if on]
    if refused:
        refused_text = ", ".join(refused)
        what = f"--leak {leak.kind} is" if defended is None else f"states under --source {defended} are"
        raise LminvertError(f"{what} searched in the rows' own space, which takes no {refused_text}")
