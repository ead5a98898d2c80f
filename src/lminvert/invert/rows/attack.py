"""The strongest attack lminvert has on one leak, for a batch of prompts: what :func:`lminvert.invert` runs for a KV
cache, defended states and one vector, and what ``lminvert audit`` runs on the leaks its defences make.

* lminvert's own states shipped whole (no defence, or a secret permutation once undone): the engine
  (:mod:`lminvert.invert.engine`), whose verdicts certify them (``exact``).
* A secret permutation of the dimensions is undone first (:func:`unpermute`): position 0's row depends on the first
  token alone, so its sorted values match those of exactly one token's row in the first-position table; aligning the
  two sorted rows gives the permutation, which every other position shares ("Hidden No More", ICML 2025, matches
  such permutation-invariant statistics). Where position 0's values tie (frequent in bfloat16) the tied dimensions
  cannot be told apart: the rows are then compared through :class:`TieSort`, which sorts values within such groups.
* Anything else (a KV cache, a public projection, positions missing, noise, quantisation): :class:`.search.RowSearch`,
  the comparison made in the shipped rows' space with the leak's error model (``noise:S``, ``quant:B``, ``float``).
  On noisy or quantised states it recovers more than the engine (SmolLM2 layer 15, ``quant:int8``, two 8-token
  prompts: 14 of 16 tokens against the engine's 5: docs/audit.md).
* The last position alone: the search for whole prompts of :mod:`lminvert.invert.last` (``last``'s options), which
  ``lminvert invert --leak last`` runs; where the vector was projected or its dimensions permuted (nothing a candidate
  prompt computes can be compared with it there), the first-position table's nearest row, compared through the map or
  by sorted values, as a guess of the last token (route ``last-table``: ``uncertain``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ...models import LoadedModel
from ...states import HiddenStates
from .. import acceptor
from ..acceptor import Evidence, Radii
from ..last import LastOptions, invert_last
from ..sources import ErrorModel, Exact, Float, parse_source
from ..tables import cached, first_position_table
from ..views import View
from .calibration import Calibration, Map, Measured, through
from .memo import StateMemo
from .rankers import Secant, StateReading
from .screen import Screen
from .search import FIRST, RowSearch

NEXT_KIND = "rows-next7"  # the cache's name for the lookahead rule's measurement (with the view's and source's); a new
# one whenever the rule changes (5: lookahead.COVER 4,096; 6: 2,048; 7: the noise bound from the observed norm at 5
# sigma, the reading fused with the prediction)


class Shipped(Protocol):
    """What an attacker holds of one prompt (an audit's defence makes one; :class:`Observed` is a plain one)."""

    @property
    def rows(self) -> torch.Tensor: ...  # [T, k]; rows of NaN: positions not shipped

    @property
    def source(self) -> str | ErrorModel | None: ...  # the rows' error model (None: the leak's own)

    @property
    def public(self) -> Map | None: ...  # a map the attacker knows: the view's rows -> the shipped rows

    @property
    def permuted(self) -> bool: ...  # the dimensions were permuted by a secret the attacker does not hold


@dataclass(frozen=True)
class Observed:
    """One prompt's rows as an attacker holds them (see :class:`Shipped`)."""

    rows: torch.Tensor
    source: str | ErrorModel | None = None
    public: Map | None = None
    permuted: bool = False


@dataclass(frozen=True)
class Recovered:
    """One prompt's attack: token ids, verdicts, seconds, candidates verified; per position the chosen row's distance,
    the nearest other's, half the gap between them, the acceptance radius and the acceptor's reason."""

    token_ids: list[int]
    verdicts: list[str]
    seconds: float
    checked: list[int]
    half_gaps: list[float | None]
    route: str  # which attack ran (engine, rows, last: a search for whole prompts, last-table: a last token's guess)
    distances: list[float]
    margins: list[float]
    tolerances: list[float]
    reasons: list[str]
    cut: int = 0  # positions the time bound limited to their first batch (:meth:`.search.RowSearch.run`)


def _error_model(source: str | ErrorModel | None) -> ErrorModel:
    """A shipped prompt's error model: ``float`` where none is said (rows computed elsewhere), else as given or
    parsed."""
    return Float() if source is None else source if isinstance(source, ErrorModel) else parse_source(source)


def unpermute(rows: torch.Tensor, table: torch.Tensor, ordered: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Rows ``[T, k]`` under a secret permutation of their dimensions, with it undone from position 0 and ``table``
    ``[V, k]`` (every token's row at position 0), and the first token it matched. ``ordered``: the table's rows sorted
    (computed when not given)."""
    ordered = table.float().sort(dim=1).values if ordered is None else ordered
    first = rows[0].float()
    token = int((ordered - first.sort().values).norm(dim=1).argmin())
    out = torch.empty_like(rows)
    out[:, table[token].float().argsort()] = rows[:, first.argsort()]
    return out, token


class TieSort:
    """A public map (leak rows -> rows): within each group of dimensions whose values in ``reference`` are equal, the
    values sorted. A permutation undone from position 0 (:func:`unpermute`) cannot tell tied dimensions apart (in
    bfloat16 many of a row's values repeat), so the attack compares rows through this map, which no order within a
    group changes. (Values that differ by less than the rounding between the shipped row and the table's could be
    swapped too; they are not grouped: in float32 that grouping merged dozens of dimensions of position 0's large
    values while the permutation was undone exactly.)"""

    def __init__(self, reference: torch.Tensor) -> None:
        values, order = reference.float().sort()
        starts = torch.cat([torch.ones(1, dtype=torch.bool), values.diff() > 0])
        self.group = torch.empty_like(order)
        self.group[order] = starts.cumsum(0) - 1  # [D] a group id per dimension
        self.slots = torch.argsort(self.group, stable=True)  # the dimensions, group by group
        self.size = len(reference) - int(starts.sum())  # dimensions beyond one per group: 0 = nothing to sort

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float()
        order = rows.argsort(dim=-1)  # by value, then (stably) by group: each group's values in ascending order
        order = order.gather(-1, torch.argsort(self.group[order], dim=-1, stable=True))
        out = torch.empty_like(rows)
        out[..., self.slots] = rows.gather(-1, order)
        return out


class Attack:
    """The attack on one leak at one layer (calibrations and tables computed once, reused for every defence; with
    ``memo``, the candidates' states the rows searches verified too: :class:`.memo.StateMemo`)."""

    def __init__(
        self, leak: View, memo: bool = True, reading: bool = True, lookahead: bool = True, first: int = FIRST,
        secant: bool = True, reuse: bool = True, screen: bool | None = None, last: LastOptions | None = None,
    ) -> None:  # fmt: skip
        """``reading``: a states leak's rows searches, and a KV cache's after block 1, take half of each position's
        rankers' order from what the row reads as (:class:`.rankers.StateReading`; a KV row read back as a state,
        :mod:`.back`); ``lookahead``: where several first tokens fit, the next row
        chooses (:class:`.search.RowSearch`; off: the nearest at position 0); ``first``: the rows searches' first
        batch at a position (then the rest of ``search.BATCH``, then ``BATCH`` per batch; ``BATCH``: every batch that
        size); ``secant``: the rows searches' later batches draw from the secant model too (:class:`.rankers.Secant`);
        ``reuse``: the recovered prefix grows from the chosen candidate's forward, only the blocks above the layer
        running for it (``RowSearch(reuse)``). The first, ``first`` and ``secant`` change which candidates run and
        when; ``reuse`` how many forwards run (and, by the prediction's rounding alone, which candidates);
        ``lookahead`` which first token is guessed, whose verdict stays ``uncertain`` either way. ``screen``: the rows
        searches screen large later batches with bfloat16 GEMMs (:mod:`.screen`; None: where it pays,
        :attr:`lminvert.models.LayerProbe.can_screen`; True on a model it cannot run on: a ValueError), which changes
        which candidates are verified in full. ``last``: the one-vector search's options (a ``last`` leak)."""
        self.leak, self.reading, self.lookahead, self.first, self.secant = leak, reading, lookahead, first, secant
        self.last = last or LastOptions()
        self.reuse = reuse
        self.model: LoadedModel = leak.model
        refusal = self.model.probe.screen_refusal
        if screen and refusal is not None:
            raise ValueError(f"screening runs a float32 model's linear layers in bfloat16; {refusal}")
        self.screen = self.model.probe.can_screen if screen is None else screen
        self.memo = StateMemo(self.model, leak.states_layer) if memo else None
        self._calibration: Calibration | None = None
        self._measured: dict[tuple, Measured] = {}  # through a public map (the audit's projections)
        self._sorted: torch.Tensor | None = None  # the table's rows sorted (for a secret permutation)

    @property
    def table(self) -> torch.Tensor:
        """Every token's row at position 0 ``[V, D]``."""
        key = ("rows-table", self.leak.name, self.leak.layer.name)  # kept on the loaded model for the next attack
        if key not in self.model.memo:
            states = first_position_table(self.model, self.leak.states_layer, progress=False).float()
            self.model.memo[key] = self.leak.rows_of(states, 0)
        return self.model.memo[key]

    @property
    def sorted_table(self) -> torch.Tensor:
        """The table's rows, each sorted: what a secret permutation of the dimensions leaves of them."""
        if self._sorted is None:
            self._sorted = self.table.sort(dim=1).values
        return self._sorted

    def run(
        self, shipped: list[Shipped], states: HiddenStates | None = None, deadline: float | None = None,
        known: Sequence[int] = (), until: int | None = None,
    ) -> list[Recovered]:  # fmt: skip
        """Attack every prompt's shipped rows; ``states``: the prompts' own layer states as :func:`lminvert.encode`
        gives them (the engine's route keeps their record of the weights: lminvert's own states are ``exact``);
        ``deadline`` (``paths.clock()``): the rows searches' time bound; ``known`` and ``until``: every prompt's first
        tokens, sure by another search, and the end of the positions searched (:meth:`.search.RowSearch.run`; whole
        rows with no public map or permutation only)."""
        first = shipped[0]
        if self.leak.name == "last":
            return self._last(shipped)
        whole = all(not torch.isnan(s.rows).any() for s in shipped) and first.public is None
        undone = [unpermute(s.rows, self.table, self.sorted_table) if s.permuted else (s.rows, None) for s in shipped]
        rows = [r for r, _ in undone]
        ties = [None if t is None else TieSort(self.table[t]) for _, t in undone]
        if any(t is not None and t.size for t in ties):  # each prompt through its own map (a search per prompt)
            return [self._tied(r, s, t, deadline) for r, s, t in zip(rows, shipped, ties, strict=True)]
        if (known or until is not None) and not (whole and not first.permuted):
            raise ValueError("known first tokens and an end are taken for whole rows with no map or permutation only")
        if self.leak.name == "states" and whole and states is not None and first.source is None:
            return self._engine(rows, states)
        return self._rows(rows, first, deadline=deadline, span=(known, until))

    def _tied(self, rows: torch.Tensor, shipped: Shipped, tied: TieSort, deadline: float | None = None) -> Recovered:
        """One prompt whose permutation was undone up to ties: searched through :class:`TieSort`, with the radii of
        the rows themselves (sorting within groups moves no row further from another, and keeps each row's norm)."""
        return self._rows([tied(rows)], replace(shipped, public=tied), self._measure(None, False), deadline)[0]

    def _rows(
        self, rows: list[torch.Tensor], first: Shipped, measured: Measured | None = None, deadline: float | None = None,
        span: tuple[Sequence[int], int | None] = ((), None),
    ) -> list[Recovered]:  # fmt: skip
        """:class:`.search.RowSearch` over every prompt's rows (``first``: a prompt's :class:`Shipped`, for its map
        and error model; ``measured``: its radii, else measured through its map; ``deadline``: the time bound;
        ``span``: every prompt's first tokens known and the end of the positions searched, as :meth:`run`'s)."""
        public = first.public
        source = _error_model(first.source)
        table = self.table if public is None else public(self.table)
        layer = self.leak.states_layer
        measured = measured or self._measure(public, source.boxed)
        reading = StateReading.of(self.model, self.leak) if self.reading and public is None else None
        secant = None
        if self.secant:
            view = (self.leak.name, self.leak.rows_of) if public is None and self.leak.name != "states" else None
            secant = Secant(self.model, layer, self.leak.name == "states" and public is None, view)
        screen = Screen(self.model, lambda: self.calibration.screened(public)) if self.screen else None
        capture = kept = None
        if public is None:  # the lookahead's rule at position 0 measured on the view's own rows (kept per source)
            kind = f"{NEXT_KIND}-{self.leak.name}-{source.label.replace(':', '-')}"
            capture = self.leak.capture

            def kept(name: str, build):
                return cached(self.model, layer, f"{kind}-{name}" if name else kind, build, per_device=True)

        # an alone view's later rows moved back to position 0, to be ranked against the table (not through a map)
        alone = self.leak.moved_back if self.leak.alone and public is None else None
        search = RowSearch(
            self.model, layer, through(self.leak.rows_of, public), source, measured, table, self.memo, reading,
            self.lookahead, self.first, secant, self.reuse, screen, capture, kept, alone,
        )  # fmt: skip
        out = []
        for r in rows:
            found = search.run(r, deadline, *span)
            measures = found.measures
            out.append(
                Recovered(
                    found.token_ids,
                    found.verdicts,
                    found.seconds,
                    found.checked,
                    found.half_gaps,
                    "rows",
                    [m.distance for m in measures],
                    [m.margin for m in measures],
                    found.tolerances,
                    found.reasons,
                    found.cut,
                )
            )
        return out

    @property
    def calibration(self) -> Calibration:
        """The calibration prompts' forwards, run once for every defence and public map (:mod:`.calibration`)."""
        if self._calibration is None:
            leak = self.leak
            self._calibration = Calibration(self.model, leak.states_layer, leak.rows_of, leak.capture, leak.name)
        return self._calibration

    def _measure(self, public, layouts: bool = False) -> Measured:
        """The radii's measurement through ``public``; ``layouts``: with other layouts' disagreement (a boxed error
        model's only slack is where the rows were computed: :meth:`.calibration.Calibration.measured`)."""
        # the view's own radii (no public map) are kept on the loaded model for the next attack on this view
        store: dict = self._measured if public is not None else self.model.memo
        key = ("rows-measured", self.leak.name, self.leak.layer.name, layouts)
        if key not in store:
            store[key] = self.calibration.measured(public, layouts)
        return store[key]

    def _engine(self, rows: list[torch.Tensor], states: HiddenStates) -> list[Recovered]:
        from .. import invert  # the public call: this module is one of its routes

        given = replace(states, states=tuple(r.to(states.states[0].dtype) for r in rows))
        results = invert(self.model, given, source=Exact(), progress=False)
        out = []
        for result in results:
            verdicts = [p.verdict for p in result.positions]
            gaps = [p.certified_radius for p in result.positions]
            out.append(
                Recovered(
                    list(result.token_ids),
                    verdicts,
                    result.seconds,
                    result.candidates_checked,
                    gaps,
                    "engine",
                    result.distances,
                    result.margins,
                    [p.tolerance for p in result.positions],
                    [p.reason for p in result.positions],
                )
            )
        return out

    def _last(self, shipped: list[Shipped]) -> list[Recovered]:
        """Each prompt's last row: searched for the whole prompt where a candidate's state can be compared with it
        (one search for all such prompts of a source), else the last token guessed from the first-position table."""
        searched = [
            i for i, s in enumerate(shipped)
            if s.public is None and not s.permuted and not torch.isnan(s.rows[-1]).any()
        ]  # fmt: skip
        out: list[Recovered | None] = [None if i in searched else self._last_token(s) for i, s in enumerate(shipped)]
        by_source: dict[str, list[int]] = {}
        for i in searched:
            by_source.setdefault(str(shipped[i].source), []).append(i)
        for indices in by_source.values():
            source = _error_model(shipped[indices[0]].source)
            vectors = [shipped[i].rows[-1].float() for i in indices]
            found = invert_last(self.model, vectors, self.leak.layer, source, self.last)
            for i, result in zip(indices, found, strict=True):
                positions = result.positions
                out[i] = Recovered(
                    list(result.token_ids), [p.verdict for p in positions], result.seconds,
                    [p.candidates_checked for p in positions], [None] * len(positions), "last",
                    [p.distance for p in positions], [p.margin for p in positions], [p.tolerance for p in positions],
                    [p.reason for p in positions],
                )  # fmt: skip
        return [r for r in out if r is not None]

    def _last_token(self, shipped: Shipped) -> Recovered:
        """The first-position table's nearest row to the last row (through the public map, or by sorted values), as a
        guess of the last token (``uncertain``: nothing bounds how far the last state lies from its token's alone)."""
        target, table = shipped.rows[-1].float(), self.table
        if shipped.public is not None:
            table = shipped.public(table)
        if shipped.permuted:  # compared by their sorted values: what a secret permutation leaves
            target, table = target.sort().values, self.sorted_table
        dists = (table.double() - target.double()).norm(dim=1)
        ids = torch.arange(len(dists))
        evidence = Evidence(ids, dists, table, target, {}, 0.0, False, exhausted=True, swept=True)
        decision = acceptor.decide(evidence, Radii(0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        verdict = acceptor.final_verdict(decision, tied=False, after_guess=False)
        d = float(dists[decision.token])
        margin = float(torch.cat([dists[: decision.token], dists[decision.token + 1 :]]).min())
        return Recovered(
            [decision.token], [verdict], 0.0, [len(ids)], [None], "last-table", [d], [margin], [math.nan],
            [decision.reason],
        )  # fmt: skip
