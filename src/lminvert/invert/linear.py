"""The default candidate policy, :class:`LinearPolicy` (and :class:`SecantPolicy`, the same without the next-token
prior): one mixer over the rankers of :mod:`.rankers`. Each ranker orders the vocabulary from one source of evidence
(the secant linear model of the position, fitted from the candidates already verified; the same fitted on this
position alone; the previous position's offset; the model's own next-token prediction; the reading of the observed
state, as it is and recentred); the mixer decides how many of each ranking's top candidates a batch takes, by each
one's record in the prompt."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from ..models import Layer, LoadedModel
from .context import PositionContext
from .policy import Policy, nearest, remaining
from .proposal import merge
from .rankers import (
    EXTRA,
    CarriedRanker,
    FitSettings,
    LocalRanker,
    OrderRanker,
    Ranker,
    Ranking,
    RereadRanker,
    SecantRanker,
    rank_of,
    top_unseen,
)
from .reading import Reading
from .sinks import SinkRanker

log = logging.getLogger(__name__)

TRUSTED = 0.75  # the proposal's recent hit rate above which a position's first batch is its top ``trusted`` alone
CARRY = 0.75  # the carried ranking's recent hit rate from which its top ``carried`` join a position's first batch
SOURCE_FLOOR = 1 / 16  # the least weight a source of the proposal's order keeps in the merge (it can recover)
STREAMS = ("secant", "reread", "proposal")  # the rankings a position's later batches draw from
STREAM_FLOOR = 1 / 16  # the least part of a later batch a ranking keeps (it can recover)
FUSED = 1.0  # the reading's weight in the fused source of the proposal (0: no fused source; :mod:`.proposal`)
# a later batch's part left by a ranking that ran out (the proposal's order holds its top 2,048) goes to the others
# (_refill; speed only: Gemma-3-270m bfloat16 layer 18, past 2,324 candidates the batches had shrunk from 512 to 73)
REFILL = True


class LinearPolicy(Policy):
    """Mix the rankers of :mod:`.rankers` into batches of candidates, by each ranking's record in the prompt.

    A position's first round, before the secant model exists (no position-1 map), verifies ``explore_first`` random
    entries. Otherwise its first batch is the *proposal* (the ``next-token``, ``reading`` and ``fused`` orders merged,
    each weighted by how often its top ``4 * first`` held the recovered token earlier in the prompt:
    :data:`SOURCE_FLOOR` at least), as many of its top entries as its record has earned, then random entries up to
    ``explore`` (which also anchor the offset). While the proposal keeps hitting (:data:`TRUSTED`) the first batch is
    its top ``trusted`` alone; while it does not and the ``carried`` ranking does (:data:`CARRY`), the
    carried ranking's top ``carried`` join and only ``anchors`` random entries are added. Later rounds take ``first *
    growth**(round-1)`` candidates (at most ``batch``), split between the ``secant`` ranking (half of its part from the
    ``local`` one, where it exists), the ``reread`` ranking and the proposal by their records (:meth:`_stream_shares`);
    after a miss, random entries are added until ``explore_max`` were verified. Every candidate is verified, so every
    setting changes speed, never the answer; why each default is what it is, with the measurements: docs/history.md
    ("The linear policy's settings").

    The secant fit's settings (``memory``, ``ridge``, ``prior``, ``outlier``, ``fresh``, ``norm_rank``,
    ``local_from``) are :class:`.rankers.FitSettings`'. A ranker is left out by its setting: ``local_from=0``
    (``local``), ``carried=0`` (``carried``), ``lm_prior=False`` (``next-token``, ``reading`` and ``fused``),
    ``reading=False`` (``reading`` and ``fused``), ``fused=0`` (``fused``: the reading's weight in it; by default
    the weight fitted for the layer's reading, :mod:`.fusion`, else :data:`FUSED`), ``reread=False`` (``reread``),
    ``sink=False`` (``sink``: at a position whose state is an attention sink, its token, where it stands apart, leads
    the first batch: :mod:`.sinks`, whose switch :data:`.sinks.SINK_LEAD` turns it off everywhere).
    ``extra``: rankers that join the later batches as streams of their own (default: one of each in
    :data:`.rankers.EXTRA`). The whole ranking runs in float32 on the model's device whatever the model's precision: a
    half-precision model only verifies candidates in its own dtype.
    """

    name = "linear"
    uses_first_table = True

    def __init__(
        self,
        explore_first: int = 512,
        explore: int = 16,
        first: int = 16,
        growth: int = 2,
        batch: int = 512,
        memory: int = 2,
        ridge: float = 1e-3,
        prior: float = 0.05,
        outlier: float = 4.0,
        fresh: int = 512,
        explore_max: int = 0,
        lm_prior: bool = True,
        reading: bool = True,
        trusted: int = 8,
        norm_rank: int = 64,
        carried: int = 16,
        anchors: int = 4,
        local_from: int = 64,
        reread: bool = True,
        extra: Sequence[Ranker] | None = None,
        fused: float | None = None,
        sink: bool = True,
    ) -> None:
        self.explore_first, self.explore, self.first, self.growth = explore_first, explore, first, growth
        self.batch, self.explore_max, self.lm_prior, self.reading = batch, explore_max, lm_prior, reading
        self.trusted, self.carried, self.anchors, self.reread = trusted, carried, anchors, reread
        self.fit_settings = FitSettings(memory, ridge, prior, outlier, fresh, norm_rank, local_from)
        self.secant = SecantRanker(self.fit_settings)
        self.local = LocalRanker(self.secant) if local_from else None
        self.carrier = CarriedRanker(self.secant) if carried > 0 else None
        self.sources = [OrderRanker("next-token", 0)] if lm_prior else []
        self.fused = (FUSED if fused is None else fused) if lm_prior and reading else 0.0
        self.fit_fused = fused is None and self.fused > 0  # the default weight: fitted per layer (:mod:`.fusion`)
        if lm_prior and reading:
            self.sources.append(OrderRanker("reading", 1))
        if self.fused > 0:
            self.sources.append(OrderRanker("fused", 2))
        self.rereader = RereadRanker(outlier) if reread else None
        self.extra = [make() for make in EXTRA] if extra is None else list(extra)
        self.sink = SinkRanker() if sink else None
        mixed = [self.secant, self.local, self.carrier, *self.sources, self.rereader, *self.extra, self.sink]
        self.rankers: dict[str, Ranker] = {r.name: r for r in mixed if r is not None}  # the rankers mixed, by name
        self._lm_order: torch.Tensor | None = None  # the proposal: the sources' orders merged
        self._sources: torch.Tensor | None = None  # [sources, depth]: each source's own order at this position
        self._source_names: list[str] = []  # ... and which source each row is
        self._source_shares: dict[str, float] = {}  # each source's recent success in this prompt (the merge's weights)
        self._lm_share = 1.0  # recent success of the proposal in this prompt (1: always right)
        self._carried_order: torch.Tensor | None = None  # this position's carried ranking (for its hit rate)
        self._carried_share = 0.0  # recent success of that ranking in this prompt (earned: 0 at first)
        self._first_scores: dict[str, Ranking] = {}  # the later batches' rankings at a position's first ranked round
        self._stream_logs: dict[str, float] = {}  # each ranking's recent log2(2 + rank of the token) in this prompt

    @property
    def uses_next_tokens(self) -> bool:  # type: ignore[override]
        return self.lm_prior

    @property
    def uses_reading(self) -> bool:  # type: ignore[override]
        return self.lm_prior and self.reading

    def prepare(
        self, model: LoadedModel, layer: Layer, first_table: bool = True, reading: Reading | None = None
    ) -> None:
        probe = model.probe
        probe.vocab_dots(torch.zeros(probe.hidden_size, device=probe.device))  # makes the ranking's float16 copy
        for ranker in self.rankers.values():  # position 0 is decided by the table; position 1 starts from its map
            ranker.prepare(model, layer, first_table, reading)

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None = None) -> None:
        for ranker in self.rankers.values():
            ranker.begin_prompt(states, readings)
        self._lm_share = 1.0
        self._source_shares = {}
        self._carried_order, self._carried_share = None, 0.0
        self._first_scores, self._stream_logs = {}, {}

    def rankings(self, ctx: PositionContext) -> dict[str, Ranking]:
        """Every ranker's ranking at this point of the position (those that have one), and the merged proposal."""
        found = {name: ranker.scores(ctx) for name, ranker in self.rankers.items()}
        if self._lm_order is not None:
            found["proposal"] = self._lm_order
        return {name: ranking for name, ranking in found.items() if ranking is not None}

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        if ctx.rounds == 0:
            for ranker in self.rankers.values():
                ranker.begin_position(ctx)
            self._take_order(ctx)
            if self.secant.jac is None:
                return self._led(ctx, remaining(ctx, ctx.generator, self.explore_first * ctx.scale))
            return self._led(ctx, self._first_batch(ctx))
        if self.secant.refit_due(ctx):
            self.secant.fit(ctx)
        return self._later_batch(ctx)

    def _led(self, ctx: PositionContext, picks: torch.Tensor) -> torch.Tensor:
        """A first batch with the sink's lead first where the position is a sink (:mod:`.sinks`)."""
        ranking = None if self.sink is None else self.sink.scores(ctx)
        if ranking is None:
            return picks
        lead = ctx.unseen(ranking, len(ranking)).to(picks.device)
        return torch.cat([lead, picks[~torch.isin(picks, lead)]])

    def _first_batch(self, ctx: PositionContext) -> torch.Tensor:
        """The proposal's likely tokens (as many as it has earned in this prompt), the carried ranking's (while it
        keeps hitting), random entries for the rest: all anchor the offset; with an unhelpful proposal (random token
        ids) this is the secant policy's start."""
        trusted = self._lm_order is not None and self._lm_share >= TRUSTED  # it keeps hitting: its top few alone
        explore = (self.trusted if trusted else self.explore) * ctx.scale
        likely = round(explore * self._lm_share) if self._lm_order is not None else 0
        picks = ctx.unseen(self._lm_order, likely) if likely else ctx.all_ids()[:0]
        carried = None if trusted or self.carrier is None else self.carrier.scores(ctx)
        if carried is not None:
            self._carried_order = nearest(carried, self.carried * ctx.scale + ctx.checked)
            if self._carried_share >= CARRY:  # it keeps hitting: its top few, and fewer random anchors
                ranked = ctx.unseen(self._carried_order, self.carried * ctx.scale)
                picks = torch.cat([picks, ranked[~torch.isin(ranked, picks)]])
                explore = len(picks) + self.anchors * ctx.scale
        if len(picks) < explore:
            extra = remaining(ctx, ctx.generator, explore)
            picks = torch.cat([picks, extra[~torch.isin(extra, picks)][: explore - len(picks)]])
        return picks

    def _later_batch(self, ctx: PositionContext) -> torch.Tensor:
        """A later round's batch: each stream's top unseen candidates, as many as its record in the prompt earns."""
        rounds = ctx.rounds
        size = min(self.batch, self.first * self.growth ** (rounds - 1)) * ctx.scale
        share = self._stream_shares()
        streams = {"secant": self.secant.scores(ctx)}
        reread = None if self.rereader is None else self.rereader.scores(ctx)
        if reread is not None:
            streams["reread"] = reread
        if self._lm_order is not None:
            streams["proposal"] = self._lm_order
        for ranker in self.extra:
            ranking = ranker.scores(ctx)
            if ranking is not None:
                streams[ranker.name] = ranking
        if rounds == 1:  # the first rankings of the position: their records learn from them
            self._first_scores = dict(streams)
        picks = ctx.all_ids()[:0]
        for name, ranking in streams.items():
            assert ranking is not None
            count = max(1, round(size * share[name]))
            top = top_unseen(ctx, ranking, count)
            alone = self.local.scores(ctx) if name == "secant" and self.local is not None else None
            if alone is not None:  # half of the secant's part from the fit of this position alone
                second = top_unseen(ctx, alone, count)
                half = count - count // 2
                top = torch.cat([top[:half], second[~torch.isin(second, top[:half])]])[:count]
            picks = top if not len(picks) else torch.cat([picks, top[~torch.isin(top, picks)]])
        if self._lm_order is not None:
            picks = picks.unique()
        picks = _refill(ctx, picks, streams, share, size)
        if rounds >= 2 and ctx.checked < self.explore_max:
            # the ranking missed: add unbiased samples (as many as we have) so the next fit is local
            extra = max(self.explore * ctx.scale, min(ctx.checked, self.explore_max - ctx.checked))
            picks = torch.cat([picks, remaining(ctx, ctx.generator, extra)]).unique()
        return picks

    def _stream_shares(self) -> dict[str, float]:
        """Each ranking's part of a later batch (:data:`STREAMS`): the best by its record in this prompt gets all of
        ``size``, another ``2**-(its mean log2 rank - the best's)`` of it, at least :data:`STREAM_FLOOR` (so that it
        can recover); before any record, all of it each."""
        logs = self._stream_logs
        best = min(logs.values(), default=0.0)
        names = [*STREAMS, *(ranker.name for ranker in self.extra)]
        return {name: max(STREAM_FLOOR, 2.0 ** (best - logs[name])) if name in logs else 1.0 for name in names}

    def end_position(self, ctx: PositionContext) -> None:
        for ranker in self.rankers.values():
            ranker.end_position(ctx)
        if self._lm_order is None:  # decided before the policy proposed (:mod:`.speculation`)
            self._take_order(ctx)  # the proposal's record still learns from it

    def _take_order(self, ctx: PositionContext) -> None:
        """This position's proposal: the sources' orders merged, each weighted by its recent record in this prompt
        (:data:`SOURCE_FLOOR` at least): where one keeps missing (the next-token prior on random token ids) the other's
        ranks are not diluted by it. The fused source's weight is at most the next-token prior's: where the prior is
        wrong and sure (random token ids), the product follows it (SmolLM2 layer 30, 4 random-id prompts: 18% more
        candidates with the fused source weighted by its own record alone)."""
        found = [(r.name, order) for r in self.sources if (order := r.scores(ctx)) is not None]
        if not found:
            self._sources = self._lm_order = None
            return
        self._source_names = [name for name, _ in found]
        self._sources = torch.stack([order for _, order in found])
        shares = {name: self._source_shares.setdefault(name, 1.0) for name, _ in found}
        if "fused" in shares and "next-token" in shares:  # it leans on the prior: no more trusted than the prior
            shares["fused"] = min(shares["fused"], shares["next-token"])
        weights = [max(SOURCE_FLOOR, shares[name]) for name, _ in found]
        self._lm_order = merge(self._sources, weights)

    def accepted(self, position: int, token_id: int) -> None:
        for name, ranking in self._first_scores.items():  # the token's rank in each of the position's first rankings
            record = math.log2(2 + rank_of(ranking, token_id))
            self._stream_logs[name] = 0.5 * self._stream_logs.get(name, record) + 0.5 * record
        self._first_scores = {}
        if self._sources is not None:
            depth = 4 * self.first
            hits = (self._sources[:, :depth] == token_id).any(dim=1).tolist()
            for name, hit in zip(self._source_names, hits, strict=True):
                self._source_shares[name] = 0.5 * self._source_shares[name] + 0.5 * hit
            self._sources = None
        if self._carried_order is not None:  # did the carried ranking have this token in its top few?
            hit = bool((self._carried_order[: self.carried] == token_id).any())
            self._carried_share = 0.5 * self._carried_share + 0.5 * hit
            self._carried_order = None
        if self._lm_order is not None:  # how well did the proposal rank this token? (random ids: badly)
            hit = bool((self._lm_order[: 4 * self.first] == token_id).any())
            self._lm_share = 0.5 * self._lm_share + 0.5 * hit
            self._lm_order = None


def _refill(
    ctx: PositionContext, picks: torch.Tensor, streams: dict[str, Ranking], share: dict[str, float], size: int
) -> torch.Tensor:
    """``picks`` topped up to ``size`` where a ranking ran out of unseen candidates: each ranking with more to give
    adds its part of what is missing (by ``share``), its best unseen candidates not picked yet. Switch:
    :data:`REFILL`."""
    short = size - len(picks)
    if not REFILL or short <= 0:
        return picks
    asked = {name: max(1, round(size * share[name])) for name in streams}
    live = [name for name in streams if len(top_unseen(ctx, streams[name], asked[name] + 1)) > asked[name]]
    total = sum(share[name] for name in live)
    for name in live:
        more = top_unseen(ctx, streams[name], asked[name] + max(1, round(short * share[name] / total)))
        picks = torch.cat([picks, more[~torch.isin(more, picks)]])
    return picks


class SecantPolicy(LinearPolicy):
    """The linear policy without the next-token prior: the secant ranking alone (for comparison)."""

    name = "secant"

    def __init__(self, **settings) -> None:
        super().__init__(**{"lm_prior": False, "explore_max": 4096, **settings})
