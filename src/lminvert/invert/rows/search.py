"""Inversion of rows that are a known function of each position's state (a KV cache, a public projection, states with
positions missing): SIPIT with the comparison made in the rows' space.

For each position, the candidates' states are computed over the recovered prefix's KV cache
(:meth:`lminvert.models.LayerProbe.continuation`), turned into rows by the leak (and the public map, if any), and their
L2 distances to the observed row are the evidence; :func:`lminvert.invert.acceptor.decide` alone gives the token and its
verdict. Every distance is measured by the cached forward, with its rounding inside the radii, but at position 0, whose
nearest candidates are also run alone through the view's own capture where the source may be a plain forward's bit for
bit and the table does not reproduce the row (:meth:`.replay.Replay.first`), and at a later position where the acceptor
finds several fit, whose nearest are replayed through that capture shaped like the observer's forward
(:meth:`.replay.Replay.later`: only a bit-for-bit reproduction is recorded). Candidates come from rankers: position 0
from the first-position table (every token verified at once), later positions the model's own next-token prediction from
the prefix (:mod:`.prediction`; a KV cache's from its rows read back, once per prompt) (for a states leak, with what the
row reads as: :meth:`StateReading.ranked`; a KV cache's row read back as a state first, :mod:`.back`; for a view whose
rows depend on their token and position alone, block 1's cache, the table's rows nearest the row moved back to position
0 instead), 16 of them first, then the rest of the first 256, then 256 at a time. Later batches merge that order with
the engine's secant model of the position's map (:class:`.rankers.Secant`) and, from 256 verified, a ridge fit on this
position's closest candidates (:class:`.rankers.Ridge`), the order remade as the position's candidates double. Where
several first tokens fit position 0's row (an attention sink's norm lets noise cover the gaps between them) or none
does, the next row chooses among the nearest (``lookahead``, :mod:`.lookahead`: ``confident`` where the next row fits
under one first token alone, else a guess), and position 1 verifies the next token it was chosen under first; so is a
later guess whose state is sink-like (a capture made elsewhere), and a missing row's token the same way, the prediction
first (a guess: uncertain, and so is everything after it). Distances are the error model's
(:meth:`lminvert.invert.sources.ErrorModel.distances`: L2, or L2 beyond a quantisation's box). The recovered prefix's
cache grows a token at a time, from the chosen candidate's forward where it can (:class:`.running.Running`); later
batches of 64 or more may be screened with bfloat16 GEMMs first (:mod:`.screen`).

A :class:`StateMemo` shared by one leak and layer's searches keeps every verified candidate's state by its prefix. Radii
are measured (:class:`.calibration.Calibration`: the cached forward's rows against a plain forward's, the deployment's
own rows against the plain forward's, the smallest gap from a true row to a random candidate's, sinks included); the
source's error model adds the defence's bound on the shipped row. Beyond a quantisation's box no ball is decisive.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ...models import LoadedModel, Prefix
from ...models.ties import tied_twins
from ...paths import past
from .. import acceptor
from ..acceptor import Evidence, Radii
from ..proposal import merge, ranked
from ..sources import ErrorModel
from ..tables import first_position_table
from ..tolerance import FLOOR, SAFETY, norm
from .calibration import Measured, Rows
from .lookahead import Lookahead
from .memo import StateMemo
from .prediction import Prediction
from .rankers import Ridge, Secant, StateReading
from .replay import Replay
from .running import Running
from .screen import Screen, Screened
from .sinklike import SinkLike
from .verified import Found, Measure, Verified, measure

BATCH = 256  # candidates verified per forward, at most
# the first batch at a position after the first (RowSearch._sizes): the rankers put a fitting row's true token among
# their first 16 at most positions (SmolLM2 block 15's KV cache, 24 prompts: 0.93x the median of 32; docs/results.md)
FIRST = 16
# candidates offered once at a position after a guess under which the row before fitted nothing (the prefix is likely
# wrong: SmolLM2 layer 15, drop:0.25, two prompts: 512 recovered as many tokens as 1,024, and 256 three fewer)
BROKEN = 2 * BATCH
ALONE_TABLE = True  # an alone view's later candidates' layer-0 states from the first-position table (False: a forward)
PARTIAL = True  # a position's first batch from the rankers' first candidates alone, by partial sorts (the whole order,
# RowSearch._position's base, made only where a later batch is due; False: the whole order first)
# the ridge fit's distances along its prediction's STRONGEST directions alone (rankers.Ridge; None: all; block 15's KV
# cache, 16 held-out prompts: 0.943x the median, 0.970x the mean, docs/results.md)
STRONGEST: int | None = 128
RERANK = 2  # the rankers' order at a position is remade once its candidates grew this many times since it was last made
# (1: after every batch; a search through the vocabulary spent most of its time remaking it: tiny-llama, 11.7 -> 2.2 s)


class RowSearch:
    """One prompt's inversion from rows (see the module docstring)."""

    ridge_from = BATCH  # verified candidates from which a ridge fit joins the order at a position

    def __init__(
        self, model: LoadedModel, layer, rows_of: Rows, source: ErrorModel, measured: Measured,
        table: torch.Tensor | None = None, memo: StateMemo | None = None, reading: StateReading | None = None,
        lookahead: bool = True, first: int = FIRST, secant: Secant | None = None, reuse: bool = True,
        screen: Screen | None = None, capture: Callable[[list[int]], torch.Tensor] | None = None,
        kept: Callable[[str, Callable[[], torch.Tensor]], torch.Tensor] | None = None,
        alone: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``table``: every token's row at position 0 ``[V, k]`` (computed from the first-position table when not
        given); ``memo``: states kept across searches at this layer (None: every candidate is run through the model);
        ``reading``: what shipped states read as (:class:`StateReading`, a states leak only; None: the rankers' order is
        the model's prediction alone); ``lookahead``: where several first tokens fit, the next row chooses among them
        (False: the nearest at position 0); ``first``: the first batch of candidates at a position after the first, then
        the rest of ``BATCH``, then ``BATCH`` per batch (``BATCH``: every batch that size); ``secant``: the secant model
        that joins the rankers' order after a position's first batch (None: the rankers' order alone until ``BATCH``
        candidates are verified, then the ridge fit's beside it); ``reuse``: the recovered prefix grows from the chosen
        candidate's forward, only the blocks above the layer running for it, which gives the next prediction too
        (:class:`.running.Running`; False: a forward through every block); ``screen``: large later batches are screened
        with bfloat16 GEMMs first (:mod:`.screen`; None: not); ``capture`` and ``kept``: the view's own rows of a prompt
        and where to keep what they measure, for :class:`.lookahead.Lookahead`'s rule at position 0 (None: a choice
        there by the next row is a guess); ``alone``: where a view's rows do not depend on the tokens before them
        (:attr:`lminvert.invert.views.View.alone`), the map of rows at a position back to position 0
        (:meth:`~lminvert.invert.views.View.moved_back`): a later position's candidates are then verified in the order
        of their table rows' L2 distance to its row moved back, with no prediction and no forward through the blocks
        above (None: the rankers' order)."""
        if memo is not None and (memo.probe is not model.probe or memo.layer != layer):
            raise ValueError("the memo holds another model's or another layer's states")
        self.model, self.layer, self.rows_of, self.memo = model, layer, rows_of, memo
        self.reading, self.lookahead, self.secant, self.reuse, self.screen = reading, lookahead, secant, reuse, screen
        if not 1 <= first <= BATCH:
            raise ValueError(f"the first batch must hold 1 to {BATCH} candidates, not {first}")
        self.first, self.alone = first, alone
        self._norms: torch.Tensor | None = None  # the table's squared row norms, for an alone view's order
        self.source = source.calibrated(measured.first, measured.rest)
        self.sinks = SinkLike(model, layer) if source.needs_calibration else None  # a leak computed elsewhere
        self.rounding, self.gap = measured.rounding, measured.gap
        # a half-precision model's cached forward need not round as the observer's whole forward does, even where the
        # calibration prompts found them equal: the rounding radius never falls below one unit of its precision
        self.floor = max(FLOOR, float(torch.finfo(model.probe.dtype).eps))
        self.ridge = Ridge.of(model.probe, STRONGEST)
        if table is None:
            table = rows_of(first_position_table(model, layer, progress=False).float(), 0)
        self.table = table
        self.twins = tied_twins(model)
        self.replay = Replay(capture, self.source)
        self.length = 0  # the rows of the prompt being searched
        self.predict = Prediction(model, layer, reading, memo, reuse)
        self.ahead = Lookahead(self, capture, kept)

    def radii(self, shipped: torch.Tensor, t: int) -> Radii:
        """Every distance here is a cached forward's, so (as in :mod:`lminvert.invert.reference`, whose distances are
        all plain) the plain radius is the cached one: the error bound plus the cached forward's rounding. The gap is
        the calibration's (:attr:`.calibration.Measured.gap`) at the row's norm, as the engine's."""
        bound = self.source.distance_bound(shipped, t)
        size = norm(shipped)
        rounding = SAFETY * max(self.rounding, self.floor) * size
        # beyond a quantisation's box no ball is decisive: a row within its distance may lie anywhere in the box
        gap = 0.0 if self.source.boxed else self.gap * size
        return Radii(bound + rounding, bound + rounding, bound, rounding, gap, FLOOR * size)

    def run(
        self, shipped: torch.Tensor, deadline: float | None = None, known: Sequence[int] = (), until: int | None = None
    ) -> Found:
        """Invert one prompt's rows ``[T, k]`` (NaN rows: missing); from ``deadline`` (``paths.clock()``) on, a position
        gets its first batch of candidates at most and nothing is chosen by the next row (:attr:`Found.cut`); ``known``
        first tokens taken as they are (:meth:`.verified.Found.given`); only the positions before ``until`` searched."""
        start, self.length = time.perf_counter(), len(shipped)
        trail, cut = Found.given(known), 0
        ids = trail.token_ids
        after_guess, broken, fitted = False, False, bool(known)
        # the next token a position was chosen under (by the next row), verified first at the position after it (led)
        lead, led = None, 1
        reads = self.reading.scores(shipped) if self.reading is not None else [None] * len(shipped)
        running = self.predict.start(shipped, known)
        if self.secant is not None:
            self.secant.begin_prompt()
        for t, row in enumerate(shipped[len(known) : until].float(), start=len(known)):
            after = shipped[t + 1].float() if t + 1 < len(shipped) else None
            following = reads[t + 1] if t + 1 < len(shipped) else None
            # after a guess under which the last row fitted nothing, the prefix is likely wrong: this position is
            # offered BROKEN candidates at most, and a missing one is not chosen by the next row
            budget = BROKEN if after_guess and broken else None
            late = past(deadline)
            if late and t > 0:  # position 0 is the table's: every token at once, no forward
                budget = min(budget or self.first, self.first)
            missing = bool(torch.isnan(row).any())
            if missing:
                decision, count, fit = self.ahead.missing(ids, after, following, running, broken or late, deadline)
                chosen, broken = Measure(), not fit
            else:
                # an alone view's candidates need no running prefix: its rows do not read it
                decision, count, chosen = self._position(
                    ids, row, t, fitted, reads[t], None if self.alone else running, budget,
                    lead if t == led else None, after_guess,
                )  # fmt: skip
                broken = decision.unfitted
            ahead = decision.guess and self.lookahead and after is not None and not torch.isnan(after).any()
            # a choice by the next row is due at position 0, and at a later guess whose state is sink-like
            due = ahead and (t == 0 or (not missing and not after_guess and self._sinklike(ids, decision.token)))
            if due and t == 0 and not past(deadline):
                dists = self.source.distances(self.table, row)
                decision, looked, lead = self.ahead.first(row, dists, after, following, deadline=deadline)
                count += looked
                chosen = measure(torch.arange(len(dists)), self.table, dists, decision.token)
            elif due and not past(deadline):  # under the next token
                order, own = self._order(ids, reads[t], running, decision.token, row), decision.token
                decision, looked, lead = self.ahead.later(ids, row, order, after, following, running, deadline=deadline)
                count, chosen, led = count + looked, chosen if decision.token == own else Measure(), t + 1
                decision, looked, chosen = self.ahead.replayed(ids, row, reads[t], running, decision, chosen, deadline)
                count += looked
            cut += (late and t > 0) or (due and decision.guess and past(deadline))  # limited by the bound
            assert decision.token is not None
            verdict = acceptor.final_verdict(decision, tied=decision.token in self.twins, after_guess=after_guess)
            after_guess = after_guess or decision.guess
            # after a guess, later positions fit only if it was right: they are not searched through the vocabulary
            fitted = (fitted and not decision.guess) or verdict != acceptor.UNCERTAIN
            tolerance = math.nan if torch.isnan(row).any() else self.radii(row, t).cached
            trail.add(decision.token, verdict, count, chosen, tolerance, decision.reason)
            running.add(decision.token)
        return replace(trail, seconds=time.perf_counter() - start, cut=cut)

    def _sinklike(self, prefix: list[int], token: int | None) -> bool:
        """Whether ``token``'s state after ``prefix`` is sink-like (:mod:`.sinklike`; never for lminvert's own
        states)."""
        return self.sinks is not None and token is not None and self.sinks.fragile(prefix, token, self.memo)

    def _decided(self, evidence: Evidence, radii: Radii, prefix: list[int], seen: Verified,
                 lead: int | None = None) -> acceptor.Decision:  # fmt: skip
        """The acceptor's decision; where several candidates fit a later position's row, or ``lead`` (another rule's
        choice) was given and nothing is certified, after their replay through the view's capture
        (:meth:`.replay.Replay.later`) when one reproduced the row; a confident sink-like one, again with that said."""
        decision = acceptor.decide(evidence, radii)
        led = lead if decision.final and decision.verdict != acceptor.CERTIFIED else None  # another rule's choice
        if (led is not None or decision.reason == acceptor.SEVERAL) and self.replay.later(
            prefix, self.length, seen, evidence.dists, evidence.ids, radii, led
        ):
            decision = acceptor.decide(evidence, radii)
        if decision.verdict == acceptor.CONFIDENT and self._sinklike(prefix, decision.token):  # asked again, so told
            return acceptor.decide(evidence, replace(radii, fragile=True))
        return decision

    def _order(
        self, prefix: list[int], reading: torch.Tensor | None, running: Running | None, lead: int | None,
        target: torch.Tensor, top: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Every token, in the order a position's candidates are verified: position 0's table by id, later ones
        by their rows' distance to ``target`` in an alone view, else the rankers' (:meth:`_ranked`); ``lead`` first
        where given; ``top``: at least the first ``top`` of that order (all of it at position 0)."""
        if not prefix:
            order = torch.arange(self.model.probe.vocab_size)
        elif self.alone is not None:  # the nearest rows first: ||a - b||^2 = ||a||^2 - 2 a.b + ||b||^2
            back = self.alone(target[None].float(), len(prefix))[0]
            if self._norms is None:  # this search's table's (another search may hold another table)
                self._norms = self.table.square().sum(1)
            order = ranked(self._norms - 2 * (self.table @ back), top=top)
        else:
            order = self._ranked(prefix, reading, running, top)
        return order if lead is None else torch.cat([torch.tensor([lead]), order[order != lead]])

    def _ranked(
        self, prefix: list[int], reading: torch.Tensor | None, running: Running | None, top: int | None = None
    ) -> torch.Tensor:
        """Every token (``top``: the first ``top``), by the model's prediction and, where given, the row's ``reading``
        (its log-probabilities: :meth:`.rankers.StateReading.ranked`)."""
        if reading is None or self.reading is None:
            return self.predict.ranked(prefix, running, top)
        return self.reading.ranked(self.predict.log_probs(prefix, running), reading, top)

    def _whole(self, head: torch.Tensor, make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A position's whole order, made by ``make`` when first asked for: ``head`` (its first candidates, as
        :meth:`_order` gave them) where that holds every token already."""
        return (lambda: head) if len(head) == self.model.probe.vocab_size else functools.cache(make)

    def _prefix(self, prefix_ids: list[int], running: Running | None) -> Callable[[], Prefix]:
        """The probe's prefix of ``prefix_ids``, made where first called: ``running``'s where it holds them, else
        made once in one forward."""
        if running is not None and running.holds(prefix_ids):
            return running.prefix
        return functools.cache(lambda: self.model.probe.prefix(prefix_ids, self.layer))

    def _reranked(
        self, ids: torch.Tensor, rows: torch.Tensor, target: torch.Tensor, base: torch.Tensor,
        carried: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The order of the next batch at a position: ``base`` (the rankers' own) merged with the secant model's
        (``carried``, where there is one) and, once ``BATCH`` candidates are verified, the ridge fit's; ``base`` alone
        where there is neither. (A ridge fit on a few dozen candidates chosen by the rankers orders the
        vocabulary badly; SmolLM2 layer 15, fp8: a true token the fit on 256 put in the next batch stayed out of 1,248
        when the fit replaced the rankers' order from 32.)"""
        streams = [] if carried is None else [carried]
        if len(ids) >= BATCH:
            streams.append(self.ridge.order(ids, rows, target))
        return merge(torch.stack([*streams, base])) if streams else base

    def _sizes(self):
        """The batch sizes at a position after the first: ``first``, the rest of ``BATCH``, then ``BATCH`` for ever (a
        position that needs more than ``first`` usually needs many more, and a forward's cost on a CPU is mostly its
        own below a few dozen candidates: SmolLM2's block-15 cache, held-out prompts, took 1.17x the time doubling the
        candidates with each batch, 1.08x with 32 more in the order remade after the first 32 before the rest, and
        0.96-1.14x in three runs with a first batch of 8 where the ball is decisive, docs/results.md)."""
        yield self.first
        if self.first < BATCH:
            yield BATCH - self.first
        while True:
            yield BATCH

    def _verify(
        self, prefix_ids: list[int], ids: torch.Tensor, prefix: Callable[[], Prefix] | None = None,
        ran: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The rows of candidates ``ids`` at the position after ``prefix_ids`` (``prefix()``: the probe's prefix,
        made only where a candidate is run through the model; ``ran``: runs them instead, over the search's own
        prefix: :meth:`.running.Running.candidates`)."""
        probe, t = self.model.probe, len(prefix_ids)
        if t == 0:
            return self.table[ids]
        if self.alone is not None and int(self.layer) == 0 and ALONE_TABLE:
            # an alone view's states are the input vectors, whatever came before: the layer-0 table's rows, the cached
            # forward's own bit for bit (both run the embedding alone), without a prefix made for each position
            return self.rows_of(first_position_table(self.model, self.layer, progress=False)[ids.to(probe.device)], t)
        made = prefix or (lambda: probe.prefix(prefix_ids, self.layer))

        def compute(missing: torch.Tensor) -> torch.Tensor:
            if ran is not None:
                return ran(missing)
            with torch.no_grad():
                return probe.continuation(made(), missing.to(probe.device))

        return self.rows_of(compute(ids) if self.memo is None else self.memo.states(prefix_ids, ids, compute), t)

    def _batch(
        self, prefix_ids: list[int], batch: torch.Tensor, prefix: Callable[[], Prefix],
        ran: Callable[[torch.Tensor], torch.Tensor] | None, target: torch.Tensor, out: Screened | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """A batch's candidates verified in full, their rows, and every candidate's row (the screened one where it was
        screened out). With ``out``, a batch of ``SCREEN_FROM`` or more is screened first (:mod:`.screen`): the
        candidates whose screened row lies beyond ``out.radius`` join ``out``; those the memo keeps are not
        screened."""
        tried = torch.arange(len(batch))
        if out is not None and self.memo is not None and Screen.applies(len(batch)):  # only where it may screen
            tried = (~self.memo.kept(prefix_ids, batch)).nonzero().flatten()
        if out is None or self.screen is None or not Screen.applies(len(tried)) or not out.open:
            fresh = self._verify(prefix_ids, batch, prefix, ran)
            return batch, fresh, fresh
        t = len(prefix_ids)
        near, every = self.screen.split(
            batch, tried, prefix(), lambda states: self.rows_of(states, t), target, out, self.source.distances
        )
        every[near] = fresh = self._verify(prefix_ids, batch[near], prefix, ran) if near.any() else every[:0]
        return batch[near], fresh, every

    def _position(
        self, prefix_ids: list[int], target: torch.Tensor, t: int, fitted: bool, reading: torch.Tensor | None = None,
        running: Running | None = None, budget: int | None = None, lead: int | None = None, guessed: bool = False,
    ) -> tuple[acceptor.Decision, int, Measure]:  # fmt: skip
        """The decision at position ``t`` after ``prefix_ids`` (``running``: the search's recovered prefix, whose
        caches serve it where it is ``prefix_ids``; ``budget``: no candidate offered after that many; ``lead``: verified
        first; ``guessed``: an earlier position was a guess), the candidates verified, the chosen token's
        :class:`.verified.Measure`. The prompt's secant model (``secant``, where the search has one) ranks every later
        position's candidates and learns from them, the lookahead's searches of a next position too."""
        radii, vocab = self.radii(target, t), self.model.probe.vocab_size
        prefix = self._prefix(prefix_ids, running)
        # over the search's own prefix, the candidates run through it, so the token chosen grows it from their forward
        ran = running.candidates if running is not None and running.holds(prefix_ids) else None
        order = self._order(prefix_ids, reading, running, lead, target, self.first if PARTIAL else None)
        base = self._whole(order, lambda: self._order(prefix_ids, reading, running, lead, target))
        done, seen = torch.zeros(vocab, dtype=torch.bool), Verified(target, self.source.distances)
        learning = self.secant if t > 0 else None  # position 0 is the table's: nothing to learn there
        if learning is not None:
            learning.begin(t, target)
        out = None if self.screen is None or t == 0 else self.screen.screened(target, radii.plain)
        pool = seen if out is None else Verified(target, self.source.distances)  # the rankers' rows: screened ones too
        reranked = 0  # candidates checked when the order was last made
        for n, size in enumerate([vocab] if t == 0 else self._sizes()):
            if out is not None and out.count and bool(done.all()):  # every token ran: the screened-out in full now
                order = out.take()
                done[order] = False
            batch = order[~done[order]][:size]
            done[batch] = True
            # the first batch is not screened: the acceptor separates a contender only from a population of rows
            # verified in full (acceptor.POPULATION), which the rankers' first candidates make
            full, fresh, every = self._batch(prefix_ids, batch, prefix, ran, target, out if n else None)
            ids, rows, dists = seen.add(full, fresh)
            self.replay.first(t, seen, ids, dists, radii)
            known = (ids, rows) if pool is seen else pool.add(batch, every)[:2]
            if learning is not None:
                learning.add(batch, every)
            spent = bool(done.all()) and (out is None or not out.count)
            checked = len(ids) + (0 if out is None else out.count)
            evidence = Evidence(
                ids, dists, rows, target, seen.measured, radii.cached, False,
                exhausted=spent or (budget is not None and checked >= budget), swept=spent, checked=checked,
                fitted=fitted, twins=self.twins, boxed=self.source.boxed,
                expected=self.source.measured(target, t), guessed=guessed,
            )  # fmt: skip
            decision = self._decided(evidence, radii, prefix_ids, seen, lead)
            if decision.unfitted and out is not None:  # nothing fits: the screened-out that may be nearer, in full
                nearer = out.take(float(dists.min()) if len(dists) else math.inf)
                if len(nearer):
                    order, done[nearer] = nearer, False
                    continue
            if decision.final:
                if learning is not None:
                    learning.end()
                return decision, checked, measure(ids, rows, dists, decision.token)
            if checked >= RERANK * reranked:
                order, reranked = (
                    self._reranked(*known, target, base(), None if learning is None else learning.order()),
                    checked,
                )
        raise AssertionError("unreachable: position 0 verifies the whole vocabulary, others never run out of batches")
