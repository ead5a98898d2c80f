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
``uncertain``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import acceptor
from ..acceptor import Decision, Evidence, NextRow
from ..tolerance import calibration_prompts
from .running import Running
from .verified import Verified

LOOK = 8  # tokens under which the next token is sought where a position's own row does not choose one (several fit
# position 0's, or its row is missing): the nearest first tokens at position 0, the model's prediction elsewhere
COVER = 2048  # first tokens within position 0's error bound that may all be verified under the next token, in one batch
# (more: the choice is a guess; SmolLM2 layer 15: 14-558 under noise:0.01 on some prompts, 1,443 and 1,479 on 'as the
# toes of the feet were part' under two of three draws, which 1,024 left a guess; 3,500-7,700 under noise:0.03, where
# 4,096 claimed no prompt of 4 and took a test 3x the time; about 27,000 under quant:int4)
PROMPTS = 4  # calibration prompts of each kind (random ids, the model's own continuations) for the rule's rate
RIVAL = 256  # candidates the runner-up first token's own search at the next position may verify


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
    prompts (None: not measured, and a choice at position 0 stays a guess); ``kept``: where the measurement is kept
    (``(build) -> tensor``: the tables' cache)."""

    def __init__(
        self, search: Any, capture: Callable[[list[int]], torch.Tensor] | None = None,
        kept: Callable[[Callable[[], torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.search, self.capture, self.kept = search, capture, kept
        self._calibration: tuple[int, int] | None = None

    def first(
        self, row: torch.Tensor, dists: torch.Tensor, after: torch.Tensor, reading, measuring: bool = False
    ) -> tuple[Decision, int, int | None]:
        """Position 0's token chosen by the next row ``after`` (``reading``: what it reads as; ``dists``: the error
        model's distances of position 0's table to ``row``), with the acceptor's verdict on the evidence; the
        candidates this ran; and the next token it was chosen under (None: none), which the next position verifies
        first. ``measuring``: the rule's own verdict, for :meth:`calibration`."""
        search = self.search
        order = search.source.order(search.table, row)
        inside = int((dists <= search.radii(row, 0).cached).sum())
        looked = self.by_next([], order, after, reading)
        ran, evidence = looked.ran, None
        if looked.choice is not None and looked.choice.verdict != acceptor.UNCERTAIN and inside <= COVER:
            assert looked.following is not None and looked.following.token is not None
            # the choice made anew with every first token its own row allows verified under the next token at once
            choice, count, tried = self.under([], looked.following.token, order, after, None, cover=inside)
            looked, ran = replace(looked, choice=choice, tried=tried), ran + count
            following = looked.following
            if looked.under != looked.token or following.verdict == acceptor.UNCERTAIN:
                # the next position's own search under the chosen first token, the next token found verified first
                # (the rankers' order from one token of context can miss it: "Inv" + "oice", 38,786th)
                following, count, _ = search._position([looked.token], after, 1, False, reading, lead=following.token)
                ran += count
            rival_fits, count = self._rival(looked, after, reading)
            ran += count
            sure = following.verdict != acceptor.UNCERTAIN and not rival_fits
            calibration = (1, 0) if measuring else self.calibration() if sure else None
            evidence = NextRow(choice, following, True, rival_fits, calibration)
        lead = None if looked.following is None else looked.following.token
        return acceptor.chosen_by_next(looked.token, evidence), ran, lead

    def _rival(self, looked: Looked, after: torch.Tensor, reading) -> tuple[bool, int]:
        """Whether the next row fits any next token under the first token nearest to fitting it after the chosen one
        (its own search, ``RIVAL`` candidates at most); and the candidates run."""
        assert looked.tried is not None
        ids, dists = looked.tried
        others = ids != looked.token
        if not bool(others.any()):
            return False, 0
        rival = int(ids[others][dists[others].argmin()])
        decision, count, _ = self.search._position([rival], after, 1, False, reading, budget=RIVAL)
        return not decision.unfitted, count

    def calibration(self) -> tuple[int, int] | None:
        """How many calibration prompts the rule claimed (position 0 ``confident`` by the next row) and how many of
        them wrongly, under the search's error model: each prompt's first two rows as the view captures them,
        perturbed as the source would (:meth:`lminvert.invert.sources.ErrorModel.simulate`), searched as a leak is.
        Measured once (kept beside the tables); None where the search has no capture."""
        if self.capture is None:
            return None
        if self._calibration is None:
            counts = self.kept(self._measure) if self.kept is not None else self._measure()
            self._calibration = (int(counts[0]), int(counts[1]))
        return self._calibration

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
            reads = search.reading.orders(rows) if search.reading is not None else [None, None]
            dists = search.source.distances(search.table, rows[0])
            decision, _, _ = self.first(rows[0], dists, rows[1], reads[1], measuring=True)
            if decision.verdict != acceptor.UNCERTAIN:
                claims += 1
                wrong += decision.token != ids[0]
        return torch.tensor([claims, wrong], dtype=torch.float64)

    def by_next(
        self, prefix_ids: list[int], order: torch.Tensor, after: torch.Tensor, reading,
        running: Running | None = None, cover: int = 0,
    ) -> Looked:  # fmt: skip
        """The token at position ``t = len(prefix_ids)`` chosen by the next row ``after``. Given each of the first
        tokens of ``order`` in turn (``LOOK`` at most), the next token is found, then tokens at ``t`` are tried under
        it (:meth:`under`; ``cover``: the first that many of ``order`` at once) until the acceptor finds any under
        which the next row's state fits (several may: another next token would not separate them either); else the
        first try's choice. A next token already tried is not tried again."""
        search, t = self.search, len(prefix_ids)
        ran, picks, tried, guessed = 0, [], set(), set()
        found: list[tuple[int, Decision, tuple[torch.Tensor, torch.Tensor]]] = []
        queue = order[:LOOK].tolist()
        while queue and len(guessed) < LOOK:
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
            pick, under, seen = self.under(prefix_ids, following.token, order, after, running, cover)
            ran += under
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
        running: Running | None, cover: int = 0,
    ) -> tuple[Decision, int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """The acceptor's choice of the token at ``t = len(prefix_ids)`` by the next row, the next token being
        ``following``: tokens in ``order`` (the first batch ``cover`` of them at least), then by a ridge fit of the
        next row on their input vectors, a batch of two-token continuations of the prefix at a time
        (:meth:`LayerProbe.chains`; batches as :meth:`.search.RowSearch._sizes`); the tokens tried; and their ids
        and distances to the next row."""
        search = self.search
        t, probe = len(prefix_ids), search.model.probe
        radii = search.radii(after, t + 1)
        prefix = search._prefix(prefix_ids, running)()
        done = torch.zeros(len(order), dtype=torch.bool)
        seen = Verified(after, search.source.distances)
        for n, size in enumerate(search._sizes()):
            batch = order[~done[order]][: max(size, cover) if n == 0 else size]
            done[batch] = True
            pairs = torch.stack([batch, torch.full_like(batch, following)], 1).to(probe.device)
            rows = search.rows_of(probe.chains(prefix, pairs)[0][:, 1], t + 1)
            ids, rows, dists = seen.add(batch, rows)
            spent = bool(done.all())
            evidence = Evidence(
                ids, dists, rows, after, seen.measured, radii.cached, False,
                exhausted=spent, swept=spent, checked=len(ids), twins=search.twins, boxed=search.source.boxed,
            )  # fmt: skip
            decision = acceptor.decide(evidence, radii)
            if decision.final:
                return decision, len(ids), (ids, dists)
            order = search.ridge.order(ids, rows, after) if len(ids) >= search.ridge_from else order
        raise AssertionError("unreachable: the batches never end")
