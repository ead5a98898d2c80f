"""Choosing a position's token by the next row, where its own row does not choose (:class:`Lookahead`): several first
tokens fit position 0's row (an attention sink's huge norm lets noise or quantisation cover the gaps between first
tokens there), none does, or the row is missing.

Given each of the likeliest tokens in turn, the next token is found (by the search's own rankers and the prompt's secant
model, which starts from the position-1 map: after "Inv" the model's prediction put "oice" about 41,000th and the row's
reading about 31,000th, the secant model in the first batch); then tokens at the position are tried under that next
token until the acceptor finds one under which the next row fits. At position 0 the evidence of that choice goes to the
acceptor (:class:`lminvert.invert.acceptor.NextRow`): every first token its own row allows verified under the next
token, the next position's own search under the chosen one, the runner-up's own search, and how often the rule claimed a
calibration prompt wrongly under the same error model (:meth:`Lookahead.calibration`, measured on prompts the model
provides with the source's own perturbation: :meth:`lminvert.invert.sources.ErrorModel.simulate`). Where it is
``confident``, later positions are judged on their own rows; else it is a guess and every later position is
``uncertain``. A later position whose own row does not choose and whose guess's state is sink-like (a capture made
elsewhere: :mod:`.sinklike`) is chosen the same way (:meth:`Lookahead.later`): the next token found under the guess,
every token of the vocabulary verified under it, the same evidence, with the rule's rate measured on calibration prompts
with a sink at position 1."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...models.observed import attention
from ...paths import past
from .. import acceptor
from ..acceptor import Decision, Evidence, NextRow, Radii
from ..layouts import other_attention
from ..tolerance import calibration_prompts
from .running import Running
from .verified import Measure, Verified

LOOK = 8  # tokens under which the next token is sought where a position's own row does not choose one (several fit
# position 0's, or its row is missing): the nearest first tokens at position 0, the model's prediction elsewhere
COVER = 2048  # first tokens within position 0's error bound that may all be verified under the next token, in one batch
# (more: the choice is a guess; SmolLM2 layer 15: 14-558 under noise:0.01 on some prompts, 1,443 and 1,479 on 'as the
# toes of the feet were part' under two of three draws, which 1,024 left a guess; 3,500-7,700 under noise:0.03, where
# 4,096 claimed no prompt of 4 and took a test 3x the time; about 27,000 under quant:int4)
PROMPTS = 4  # calibration prompts of each kind (random ids, the model's own continuations) for the rule's rate
RIVAL = 256  # candidates the runner-up first token's own search at the next position may verify
LATER = "later2"  # the name a later sink's rule is measured under (:meth:`Lookahead.calibration`)
LATER_TRIES = 2  # guesses a later sink's next token is sought under: the position's own, then (where the next row
# fitted nothing) the token whose own row lay nearest in the chains tried (bench_sinks.py --leak kv, block 15: the rule
# claimed 4 of 8 calibration prompts, 1 with the own guess alone; sought first under the nearest of the vocabulary, a
# sweep of its own: the same tokens and verdicts on the 8 prompts, 1.34x the time)
LATER_PROMPTS = 8  # calibration prompts with a sink at position 1 for that rule (4 claimed 1: too few to say a rate)
FOLLOW = 4096  # candidates the next position's search under a later sink's guess may verify (SmolLM2 block 15, a
# random-id calibration prompt: the true next token about the 1,200th; 1,024, the give-up budget, missed it)
# a later sink-like position's choice by the next row verified again, first, and replayed first through the capture,
# where a bit-for-bit reproduction certifies it (Lookahead.replayed; False: the next row's choice stands)
REPLAY_CHOICE = True
LATER_CHUNK = 2048  # two-token chains per forward where every token is verified under the next one


@dataclass(frozen=True)
class Under:
    """A choice by the next row under one next token (:meth:`Lookahead.under`): the acceptor's decision, the
    candidates run, the tokens tried with their distances to the next row, and (where the position's own row was
    given) the token whose own row lies nearest it among those tried."""

    decision: Decision
    ran: int
    tried: tuple[torch.Tensor, torch.Tensor]
    nearest: int | None = None


@dataclass(frozen=True)
class Looked:
    """A choice by the next row: the token, the candidates run, whether the next row fitted under it, the acceptor's
    choice by the next row (None: never made), the first token the next token was found under and the next position's
    decision there, and the first tokens verified under the next token (ids, distances)."""

    token: int
    ran: int
    fit: bool
    choice: Decision | None = None
    under: int | None = None
    following: Decision | None = None
    tried: tuple[torch.Tensor, torch.Tensor] | None = None


class Lookahead:
    """The choices of one :class:`.search.RowSearch` (``search``; not imported here: it holds this) by the next row
    (see the module docstring); ``capture``: the view's own rows of a prompt, for measuring the rule on calibration
    prompts (None: not measured, and a choice by the next row stays a guess); ``kept``: where a measurement is kept
    (``(name, build) -> tensor``: the tables' cache; name "" for position 0's rule, ``LATER`` for a later sink's)."""

    def __init__(
        self, search: Any, capture: Callable[[list[int]], torch.Tensor] | None = None,
        kept: Callable[[str, Callable[[], torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.search, self.capture, self.kept = search, capture, kept
        self._calibration: dict[str, tuple[int, int]] = {}

    def first(
        self, row: torch.Tensor, dists: torch.Tensor, after: torch.Tensor, reading, measuring: bool = False,
        deadline: float | None = None,
    ) -> tuple[Decision, int, int | None]:  # fmt: skip
        """Position 0's token chosen by the next row ``after`` (``reading``: what it reads as; ``dists``: the error
        model's distances of position 0's table to ``row``), with the acceptor's verdict on the evidence; the
        candidates this ran; and the next token it was chosen under (None: none), which the next position verifies
        first. ``measuring``: the rule's own verdict, for :meth:`calibration`. Past ``deadline`` (``paths.clock()``) no
        further first token is tried and no evidence is gathered: the choice is a guess."""
        search = self.search
        order = search.source.order(search.table, row)
        inside = int((dists <= search.radii(row, 0).cached).sum())
        looked = self.by_next([], order, after, reading, deadline=deadline)
        ran, evidence = looked.ran, None
        chosen = looked.choice is not None and looked.choice.verdict != acceptor.UNCERTAIN
        if chosen and inside <= COVER and not past(deadline):
            assert looked.following is not None and looked.following.token is not None
            # the choice made anew with every first token its own row allows verified under the next token at once
            got = self.under([], looked.following.token, order, after, None, cover=inside)
            looked, ran = replace(looked, choice=got.decision, tried=got.tried), ran + got.ran
            evidence, count = self._next_row([], looked, after, reading, None if measuring else "")
            ran += count
        lead = None if looked.following is None else looked.following.token
        return acceptor.chosen_by_next(looked.token, evidence), ran, lead

    def later(
        self,
        prefix_ids: list[int],
        row: torch.Tensor,
        order: torch.Tensor,
        after: torch.Tensor,
        reading,
        running: Running | None,
        measuring: bool = False,
        deadline: float | None = None,
    ) -> tuple[Decision, int, int | None]:
        """The token at a later position ``t = len(prefix_ids)`` whose own row ``row`` did not choose and whose state
        is sink-like (:mod:`.sinklike`: the bound there may hold every token), chosen by the next row ``after``: the
        next token found under a guess (the first of ``order``, the position's own), then every token of the
        vocabulary verified at ``t`` under it (``LATER_CHUNK`` chains at a time), the acceptor choosing by the next row
        alone; where nothing fits, again under the token whose own row lay nearest ``row`` in those chains
        (``LATER_TRIES`` guesses at most). With the same evidence as at position 0 (the next position's own search
        under the choice, the runner-up's, and the rule's rate on calibration prompts with such a sink:
        :meth:`_measure_later`). Returns the decision (the own guess where the next row fits under no token), the
        candidates run, and the next token. Past ``deadline``: no further guess and no evidence (a guess)."""
        search, t = self.search, len(prefix_ids)
        cover = search.model.probe.vocab_size
        guesses, ran = [int(order[0])], 0
        for guess in guesses:
            # the prefix fitted (else this is not asked): the next position is searched past the give-up budget
            following, count, _ = search._position([*prefix_ids, guess], after, t + 1, True, reading, budget=FOLLOW)
            assert following.token is not None  # where nothing fitted, the nearest: often the true next token anyway
            got = self.under(prefix_ids, following.token, order, after, running, cover=cover, own=row)
            ran += count + got.ran
            if (not got.decision.unfitted and got.decision.token is not None) or past(deadline):
                break
            if got.nearest is not None and got.nearest not in guesses and len(guesses) < LATER_TRIES:
                guesses.append(got.nearest)
        choice = got.decision
        if choice.unfitted or choice.token is None:
            return acceptor.chosen_by_next(guesses[0]), ran, following.token
        evidence = None
        if choice.verdict != acceptor.UNCERTAIN and not past(deadline):
            looked = Looked(choice.token, ran, True, choice, guess, following, got.tried)
            evidence, count = self._next_row(prefix_ids, looked, after, reading, None if measuring else LATER)
            ran += count
        return acceptor.chosen_by_next(choice.token, evidence), ran, following.token

    def replayed(
        self, prefix_ids: list[int], row: torch.Tensor, reading, running: Running | None, decision: Decision,
        chosen: Measure, deadline: float | None = None,
    ) -> tuple[Decision, int, Measure]:  # fmt: skip
        """A later position's ``decision`` by the next row (:meth:`later`), where :data:`REPLAY_CHOICE` is on and the
        search replays (:class:`.replay.Replay`): its token verified again at the position, first, and replayed first
        through the capture (a sink's cached distance says little of which candidates to replay); where that
        reproduces ``row`` bit for bit, the acceptor's decision on that evidence replaces it. The decision, the
        candidates run, the chosen token's measure (``chosen`` where it stands)."""
        search, token = self.search, decision.token
        if not (REPLAY_CHOICE and search.replay.applies and token is not None) or past(deadline):
            return decision, 0, chosen
        again, ran, measured = search._position(prefix_ids, row, len(prefix_ids), True, reading, running, lead=token)
        if again.verdict == acceptor.CERTIFIED and again.token == token:
            return again, ran, measured
        return decision, ran, chosen

    def _next_row(
        self, prefix_ids: list[int], looked: Looked, after: torch.Tensor, reading, rule: str | None
    ) -> tuple[NextRow, int]:
        """The evidence of a choice by the next row made with every token the position's own row allows verified
        under the next token (``looked``): the next position's own search under the chosen token (the next token
        found verified first; the rankers' order from the prefix can miss it: "Inv" + "oice", 38,786th), whether the
        runner-up lets the next row fit, and ``rule``'s rate on calibration prompts (None: being measured); the
        candidates run."""
        assert looked.choice is not None and looked.following is not None
        search, t, ran = self.search, len(prefix_ids), 0
        following = looked.following
        if looked.under != looked.token or following.verdict == acceptor.UNCERTAIN:
            following, ran, _ = search._position(
                [*prefix_ids, looked.token], after, t + 1, False, reading, lead=following.token
            )
        rival_fits, count = self._rival(prefix_ids, looked, after, reading)
        sure = following.verdict != acceptor.UNCERTAIN and not rival_fits
        calibration = (1, 0) if rule is None else self.calibration(rule) if sure else None
        return NextRow(looked.choice, following, True, rival_fits, calibration), ran + count

    def _rival(self, prefix_ids: list[int], looked: Looked, after: torch.Tensor, reading) -> tuple[bool, int]:
        """Whether the next row fits any next token under the token nearest to fitting it after the chosen one (its
        own search, ``RIVAL`` candidates at most); and the candidates run."""
        assert looked.tried is not None
        ids, dists = looked.tried
        others = ids != looked.token
        if not bool(others.any()):
            return False, 0
        rival = int(ids[others][dists[others].argmin()])
        t = len(prefix_ids)
        decision, count, _ = self.search._position([*prefix_ids, rival], after, t + 1, False, reading, budget=RIVAL)
        return not decision.unfitted, count

    def calibration(self, name: str = "") -> tuple[int, int] | None:
        """How many calibration prompts the rule claimed (``confident`` by the next row) and how many of them wrongly,
        under the search's error model: position 0's rule (``name`` "": :meth:`_measure`) or a later sink's
        (``LATER``: :meth:`_measure_later`). Measured once (kept beside the tables); None where the search has no
        capture."""
        if self.capture is None:
            return None
        if name not in self._calibration:
            build = self._measure if name == "" else self._measure_later
            counts = self.kept(name, build) if self.kept is not None else build()
            self._calibration[name] = (int(counts[0]), int(counts[1]))
        return self._calibration[name]

    def _measure(self) -> torch.Tensor:
        search, claims, wrong = self.search, 0, 0
        assert self.capture is not None
        generator = torch.Generator().manual_seed(0)
        for ids in calibration_prompts(search.model, n=PROMPTS, length=2, seed=1):
            rows = search.source.simulate(self.capture(ids)[:2].float(), generator)
            if search.secant is not None:  # each calibration prompt's next-row search starts as a leak's does
                search.secant.begin_prompt()
            own, _, _ = search._position([], rows[0], 0, False)
            if not own.guess:
                continue
            reads = search.reading.scores(rows) if search.reading is not None else [None, None]
            dists = search.source.distances(search.table, rows[0])
            decision, _, _ = self.first(rows[0], dists, rows[1], reads[1], measuring=True)
            if decision.verdict != acceptor.UNCERTAIN:
                claims += 1
                wrong += decision.token != ids[0]
        return torch.tensor([claims, wrong], dtype=torch.float64)

    def _measure_later(self) -> torch.Tensor:
        """A later sink's rule (:meth:`later`) on calibration prompts of three random tokens whose second one's state
        is sink-like (:meth:`.sinklike.SinkLike.prompts`), the first token given, each as the view captures it with the
        other attention implementation where the source is states computed elsewhere in the model's dtype (what
        the ``float`` model's sink-like bands were measured against: :func:`lminvert.invert.layouts.other_attention`),
        else perturbed as the source would (:meth:`lminvert.invert.sources.ErrorModel.simulate`); claims and wrong
        claims."""
        search, claims, wrong = self.search, 0, 0
        assert self.capture is not None
        generator = torch.Generator().manual_seed(0)
        other = other_attention(search.model.probe) if search.source.name == "float" else None
        prompts = [] if search.sinks is None else search.sinks.prompts(LATER_PROMPTS)
        for ids in prompts:
            if other is not None:
                with attention(search.model.probe, other):
                    rows = self.capture(ids)[:3].float()
            else:
                rows = search.source.simulate(self.capture(ids)[:3].float(), generator)
            if search.secant is not None:
                search.secant.begin_prompt()
            reads = search.reading.scores(rows) if search.reading is not None else [None] * 3
            own, _, _ = search._position(ids[:1], rows[1], 1, True, reads[1])  # the position's own guess, as a leak's
            if not own.guess or own.token is None:
                continue
            order = search._order(ids[:1], reads[1], None, own.token, rows[1])
            decision, _, _ = self.later(ids[:1], rows[1], order, rows[2], reads[2], None, measuring=True)
            if decision.verdict != acceptor.UNCERTAIN:
                claims += 1
                wrong += decision.token != ids[1]
        return torch.tensor([claims, wrong], dtype=torch.float64)

    def missing(
        self, prefix: list[int], after: torch.Tensor | None, reading, running: Running, broken: bool,
        deadline: float | None = None,
    ) -> tuple[acceptor.Decision, int, bool]:  # fmt: skip
        """A missing position: chosen by the next row where it is shipped (:meth:`by_next`, the model's prediction
        first) and the row before fitted (``broken``: it did not, so the prefix is likely wrong and nothing would fit
        the next row), else the prediction's first token; a guess either way (no further token tried after
        ``deadline``). And the candidates this ran, and whether the next row fitted under the token (True where it was
        not tried)."""
        search = self.search
        predicted = search.predict.ranked(prefix, running)
        if after is not None and not torch.isnan(after).any() and search.lookahead and not broken:
            looked = self.by_next(prefix, predicted, after, reading, running, deadline=deadline)
            return acceptor.chosen_by_next(looked.token), looked.ran, looked.fit
        guess = predicted[:1]
        empty = torch.empty(0)
        evidence = Evidence(guess, torch.full((1,), math.inf), empty, empty, {}, 0.0, False, exhausted=True)
        return acceptor.decide(evidence, Radii(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)), 0, not broken

    def by_next(
        self, prefix_ids: list[int], order: torch.Tensor, after: torch.Tensor, reading,
        running: Running | None = None, cover: int = 0, deadline: float | None = None,
    ) -> Looked:  # fmt: skip
        """The token at position ``t = len(prefix_ids)`` chosen by the next row ``after``. Given each of the first
        tokens of ``order`` in turn (``LOOK`` at most), the next token is found, then tokens at ``t`` are tried under
        it (:meth:`under`; ``cover``: the first that many of ``order`` at once) until the acceptor finds any under
        which the next row's state fits (several may: another next token would not separate them either); else the
        first try's choice. A next token already tried is not tried again; none after ``deadline`` once one was."""
        search, t = self.search, len(prefix_ids)
        ran, picks, tried, guessed = 0, [], set(), set()
        found: list[tuple[int, Decision, tuple[torch.Tensor, torch.Tensor]]] = []
        queue = order[:LOOK].tolist()
        while queue and len(guessed) < LOOK and not (guessed and past(deadline)):
            guess = queue.pop(0)
            if guess in guessed:
                continue
            guessed.add(guess)
            following, count, _ = search._position([*prefix_ids, guess], after, t + 1, False, reading)
            ran += count
            assert following.token is not None
            if following.token in tried:
                continue
            tried.add(following.token)
            got = self.under(prefix_ids, following.token, order, after, running, cover)
            pick, seen = got.decision, got.tried
            ran += got.ran
            picks.append(pick)
            found.append((guess, following, seen))
            if not pick.unfitted:
                break
            assert pick.token is not None
            queue.insert(0, pick.token)  # the nearest under that next token is the next try
        if not picks:
            return Looked(int(order[0]), ran, False)
        last = len(picks) - 1 if not picks[-1].unfitted else 0
        pick, (under, following, seen) = picks[last], found[last]
        assert pick.token is not None
        return Looked(pick.token, ran, not picks[-1].unfitted, pick, under, following, seen)

    def under(
        self, prefix_ids: list[int], following: int, order: torch.Tensor, after: torch.Tensor,
        running: Running | None, cover: int = 0, own: torch.Tensor | None = None,
    ) -> Under:  # fmt: skip
        """The acceptor's choice of the token at ``t = len(prefix_ids)`` by the next row, the next token being
        ``following``: tokens in ``order`` (the first batch ``cover`` of them at least), then by a ridge fit of the
        next row on their input vectors, a batch of two-token continuations of the prefix at a time
        (:meth:`LayerProbe.chains`; batches as :meth:`.search.RowSearch._sizes`), with the candidates run, the tokens
        tried and their distances to the next row (``own``: the position's own row, the tried token's row nearest it
        too, from the same chains)."""
        search = self.search
        t, probe = len(prefix_ids), search.model.probe
        radii = search.radii(after, t + 1)
        prefix = search._prefix(prefix_ids, running)()
        done = torch.zeros(len(order), dtype=torch.bool)
        seen = Verified(after, search.source.distances)
        nearest, best = None, math.inf
        for n, size in enumerate(search._sizes()):
            batch = order[~done[order]][: max(size, cover) if n == 0 else size]
            done[batch] = True
            pairs = torch.stack([batch, torch.full_like(batch, following)], 1).to(probe.device)
            states = torch.cat([probe.chains(prefix, p)[0] for p in pairs.split(LATER_CHUNK)])
            if own is not None:
                mine = search.source.distances(search.rows_of(states[:, 0], t), own)
                if float(mine.min()) < best:
                    best, nearest = float(mine.min()), int(batch[mine.argmin()])
            ids, rows, dists = seen.add(batch, search.rows_of(states[:, 1], t + 1))
            spent = bool(done.all())
            evidence = Evidence(
                ids, dists, rows, after, seen.measured, radii.cached, False,
                exhausted=spent, swept=spent, checked=len(ids), twins=search.twins, boxed=search.source.boxed,
            )  # fmt: skip
            decision = acceptor.decide(evidence, radii)
            if decision.final:
                return Under(decision, len(ids), (ids, dists), nearest)
            order = search.ridge.order(ids, rows, after) if len(ids) >= search.ridge_from else order
        raise AssertionError("unreachable: the batches never end")
