"""The default candidate policy, :class:`LinearPolicy` (and :class:`SecantPolicy`, the same without the next-token
prior): a secant (least-squares) linear model of the position's map from input embeddings to states, fitted from the
candidates already verified, ranks the vocabulary by predicted distance to the target, merged with the model's own
next-token order, the reading and the carried offset by each one's record in the prompt."""

from __future__ import annotations

import logging
import math

import torch

from ..models import Layer, LoadedModel
from .context import PositionContext, wide_dtype
from .policy import Policy, nearest, remaining, unseen_nearest
from .proposal import merge
from .reading import Reading, read
from .secant import centre, fit_secant_map, projected_norms
from .tables import position1_projection, squared_norms

log = logging.getLogger(__name__)

TRUSTED = 0.75  # the proposal's recent hit rate above which a position's first batch is its top ``trusted`` alone
CARRY = 0.75  # the carried ranking's recent hit rate from which its top ``carried`` join a position's first batch
SOURCE_FLOOR = 1 / 16  # the least weight a source of the proposal's order keeps in the merge (it can recover)
STREAMS = ("secant", "reading", "proposal")  # the rankings a position's later batches draw from
STREAM_FLOOR = 1 / 16  # the least part of a later batch a ranking keeps (it can recover)
RECENT = 3  # positions whose ranks size a trusted first batch: the next power of two above their worst rank


class LinearPolicy(Policy):
    """Rank by a secant linear model ``h(v) ~ a + J e_v`` of the current position.

    ``J`` is fitted by ridge regression (:mod:`.secant`) on centred (embedding, state) pairs of verified
    candidates: those of this position plus those of the last ``memory`` positions, pulled towards the previous
    ``J``; the offset ``a`` is re-estimated at each position. The first round samples a few random entries (for
    the offset and the fit), later rounds verify the top of the ranking in growing batches, refitting as data
    arrives. After the ranking the rest is swept in order. Every setting only changes speed, never the answer (every
    candidate is verified); why each default is what it is, with the measurements: docs/history.md ("The linear
    policy's settings").

    * ``explore_first`` - random entries verified first at a position when no ``J`` exists yet;
    * ``explore`` - random entries verified first when a ``J`` exists, and the least added after a miss;
    * ``first``, ``growth``, ``batch`` - ranked candidates per round: ``first * growth**(round-1)``, at most
      ``batch``;
    * ``memory`` - how many previous positions' pairs join this position's fit;
    * ``ridge`` - ridge penalty relative to the data's energy;
    * ``prior`` - pull towards the previous ``J`` (relative to the data's energy);
    * ``outlier`` - states with a norm above ``outlier`` times the target's (attention sinks) are left out;
    * ``fresh`` - with this many pairs at the current position, fit on them alone (no memory, no prior);
    * ``explore_max`` - random samples are added after a miss until this many candidates were verified;
    * ``lm_prior`` - also rank by the model's own next-token distribution at the position (``ctx.next_tokens``,
      :mod:`.proposal`): while its recent hit rate is at least :data:`TRUSTED`, a position's first batch is its top
      tokens alone (:meth:`_trusted_size`: sized by its ranks at the last :data:`RECENT` positions, at most
      ``trusted``), and every later batch draws from that order beside the other rankings;
    * ``norm_rank`` - the ranking's squared row norms ``||e_v J||^2`` are recomputed at every refit from the top
      ``norm_rank`` eigenpairs of ``J J^T`` (:func:`.secant.projected_norms`);
    * ``local_from`` - from this many verified pairs at a position (below ``fresh``), half of every later batch is
      the ranking of a fit on this position's pairs alone;
    * ``reading`` - merge the proposal's order with the reading's (:mod:`.reading`, :mod:`.reader`): alternately at
      first, then each source weighted by its recent hit rate in this prompt (:data:`SOURCE_FLOOR` at least);
    * ``reread`` - later batches also draw from the reading recentred on the candidates verified at this position
      (:meth:`_reread_scores`); each later batch is split between the secant ranking, this one and the proposal
      order by their records in the prompt (:meth:`_stream_shares`, :data:`STREAM_FLOOR` at least);
    * ``carried``, ``anchors`` - where the prior is not trusted, a position's first batch also holds the top
      ``carried`` of the secant ranking with the previous position's offset, and only ``anchors`` random entries
      instead of ``explore``, while that ranking's recent hit rate is at least :data:`CARRY`.

    The whole ranking runs in float32 on the model's device whatever the model's precision (the fits in float64):
    a half-precision model only verifies candidates in its own dtype.
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
    ) -> None:
        self.explore_first, self.explore, self.first, self.growth = explore_first, explore, first, growth
        self.batch, self.memory, self.ridge, self.prior, self.outlier = batch, memory, ridge, prior, outlier
        self.fresh, self.explore_max, self.lm_prior, self.reading = fresh, explore_max, lm_prior, reading
        self.trusted, self.norm_rank = trusted, norm_rank
        self.carried, self.anchors, self.local_from, self.reread = carried, anchors, local_from, reread
        self._local: tuple[torch.Tensor, torch.Tensor] | None = None  # (J, norms) of this position's pairs alone
        self._lm_order: torch.Tensor | None = None
        self._sources: torch.Tensor | None = None  # [sources, depth]: each source's own order at this position
        self._source_shares: list[float] = []  # each source's recent success in this prompt (the merge's weights)
        self._lm_share = 1.0  # recent success of the next-token prior in this prompt (1: always right)
        self._recent: list[int] = []  # ranks of the last RECENT recovered tokens in the proposal's order
        self._fitted_on = 0  # samples of the current position used by the last fit
        self._pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._J: torch.Tensor | None = None
        self._P_sq: torch.Tensor | None = None  # squared row norms of vocab @ J  [V]
        self._vocab_sq: torch.Tensor | None = None  # ||e_v||^2, set by prepare()
        self._carried: torch.Tensor | None = None  # the previous position's offset
        self._carried_order: torch.Tensor | None = None  # this position's ranking with it (for its hit rate)
        self._carried_share = 0.0  # recent success of that ranking in this prompt (earned: 0 at first)
        self._prior: tuple[torch.Tensor, torch.Tensor] | None = None  # (J, P_sq) at position 1, set by prepare()
        self._read: Reading | None = None  # the proposal's reading (map or network), set by prepare()
        self._observed: torch.Tensor | None = None  # the prompt's observed states [T, d]
        self._readings: torch.Tensor | None = None  # what the reading reads from them [T, d] (when first needed)
        self._first_scores: dict[str, torch.Tensor] = {}  # the first rankings at this position
        self._stream_logs: dict[str, float] = {}  # each ranking's recent log2(2 + rank of the token) in this prompt
        self._misread: tuple[torch.Tensor | None, int, int] = (None, 0, 0)  # this position: sum of (read - e_v) over
        # the candidates read, how many, how many verified pairs were looked at

    @property
    def uses_next_tokens(self) -> bool:  # type: ignore[override]
        return self.lm_prior

    @property
    def uses_reading(self) -> bool:  # type: ignore[override]
        return self.lm_prior and self.reading

    def prepare(
        self, model: LoadedModel, layer: Layer, first_table: bool = True, reading: Reading | None = None
    ) -> None:
        self._prior = None
        self._read = reading if self.reread else None
        self._vocab_sq = squared_norms(model, "vocabulary", model.probe.vocab_matrix(torch.float32))
        probe = model.probe
        probe.vocab_dots(torch.zeros(probe.hidden_size, device=probe.device))  # makes the ranking's float16 copy
        if first_table:  # position 0 is decided by the table; position 1 starts from the position-1 map
            self._prior = position1_projection(model, layer)

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None = None) -> None:
        self._pool, self._J, self._P_sq = [], None, None
        if self._prior is not None:
            self._J, self._P_sq = self._prior
        self._lm_share = 1.0
        self._source_shares = []
        self._recent = []
        self._carried, self._carried_order, self._carried_share = None, None, 0.0
        self._observed, self._readings = states, readings
        self._first_scores, self._stream_logs = {}, {}

    def _centred(self, ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Centred (embedding, state) pairs of this position, without outliers.

        Some tokens turn a position into an attention sink (state norms ~100x the others, e.g. at position
        1 of SmolLM2); they would dominate a least-squares fit, so states with norms beyond
        ``outlier`` times the target's are left out.
        """
        wide = wide_dtype(ctx.device)
        x = ctx.probe.vocab_matrix(torch.float32)[ctx.all_ids()].to(wide)
        h = ctx.all_states().to(wide)
        keep = h.norm(dim=1) <= self.outlier * float(ctx.target.norm())
        return centre(x[keep], h[keep])

    def _fit(self, ctx: PositionContext) -> None:
        assert self._vocab_sq is not None, "prepare() first"
        x, h = self._centred(ctx)
        local = len(x) >= self.fresh  # enough data here: fit this position alone
        vocab = ctx.probe.vocab_matrix(torch.float32)
        if local:
            self._local = None
        else:
            if self.local_from and len(x) >= self.local_from:  # a second opinion from this position alone
                alone = fit_secant_map(x, h, ridge=self.ridge)
                self._local = (alone, projected_norms(vocab, self._vocab_sq, alone, self.norm_rank))
            x = torch.cat([x, *(p[0] for p in self._pool)])
            h = torch.cat([h, *(p[1] for p in self._pool)])
        prior = None if local else self._J
        self._J = fit_secant_map(x, h, ridge=self.ridge, prior=prior, prior_weight=self.prior)
        self._P_sq = projected_norms(vocab, self._vocab_sq, self._J, self.norm_rank)  # the refit's whole cost
        self._fitted_on = ctx.checked

    def _offset(self, ctx: PositionContext, jac: torch.Tensor | None = None) -> torch.Tensor:
        """The offset ``a`` of the linear model (``J`` unless ``jac``) at this position: the mean of ``h - e_v J`` over
        its verified pairs (attention sinks left out)."""
        jac = self._J if jac is None else jac
        assert jac is not None
        ids, states = ctx.all_ids(), ctx.all_states().float()
        keep = states.norm(dim=1) <= self.outlier * float(ctx.target.norm())
        if keep.any():
            ids, states = ids[keep], states[keep]
        return (states - ctx.probe.vocab_matrix(torch.float32)[ids] @ jac.float()).mean(0)

    def _secant_scores(
        self,
        ctx: PositionContext,
        offset: torch.Tensor | None = None,
        model: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[V]``: the predicted distance ``||a + e_v J - h||^2`` to the target ``h``, less ``||h - a||^2`` (``a``:
        this position's offset unless given; ``J`` and its row norms: the fit's unless ``model`` gives them)."""
        jac, norms = (self._J, self._P_sq) if model is None else model
        assert jac is not None and norms is not None
        residual = ctx.target.float() - (self._offset(ctx, jac) if offset is None else offset)
        return norms - 2.0 * ctx.probe.vocab_dots(jac.float() @ residual)

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        rounds = ctx.rounds
        if rounds == 0:
            self._fitted_on, self._local = 0, None
            self._misread = (None, 0, 0)
            self._take_order(ctx)
            if self._J is None:
                return remaining(ctx, ctx.generator, self.explore_first * ctx.scale)
            # the prior's likely tokens (as many as it has earned in this prompt), random entries for the rest:
            # both anchor the offset; with an unhelpful prior (random token ids) this is the secant policy's start
            trusted = self._lm_order is not None and self._lm_share >= TRUSTED  # it keeps hitting: its top few alone
            explore = (self._trusted_size() if trusted else self.explore) * ctx.scale
            likely = round(explore * self._lm_share) if self._lm_order is not None else 0
            picks = ctx.unseen(self._lm_order, likely) if likely else ctx.all_ids()[:0]
            if not trusted and self._carried is not None and self.carried > 0:
                carried = self._secant_scores(ctx, self._carried)
                self._carried_order = nearest(carried, self.carried * ctx.scale + ctx.checked)
                if self._carried_share >= CARRY:  # it keeps hitting: its top few, and fewer random anchors
                    ranked = ctx.unseen(self._carried_order, self.carried * ctx.scale)
                    picks = torch.cat([picks, ranked[~torch.isin(ranked, picks)]])
                    explore = len(picks) + self.anchors * ctx.scale
            if len(picks) < explore:
                extra = remaining(ctx, ctx.generator, explore)
                picks = torch.cat([picks, extra[~torch.isin(extra, picks)][: explore - len(picks)]])
            return picks
        if self._J is None or (rounds >= 2 and ctx.checked >= 2 * self._fitted_on):
            self._fit(ctx)  # refit whenever this position's data has doubled
        size = min(self.batch, self.first * self.growth ** (rounds - 1)) * ctx.scale
        share = self._stream_shares()  # each ranking's part of the batch, by its record in this prompt
        scores = {"secant": self._secant_scores(ctx)}
        if self._read is not None and ctx.position > 0:  # the reading, less its error on this position's candidates
            scores["reading"] = self._reread_scores(ctx)
        if rounds == 1:  # the first rankings of the position: their records learn from them
            self._first_scores = dict(scores)
            if self._lm_order is not None:
                self._first_scores["proposal"] = self._lm_order
        count = max(1, round(size * share["secant"]))
        picks = unseen_nearest(ctx, scores["secant"], count)
        if self._local is not None:  # half from the fit of this position alone
            alone = unseen_nearest(ctx, self._secant_scores(ctx, model=self._local), count)
            half = count - count // 2
            picks = torch.cat([picks[:half], alone[~torch.isin(alone, picks[:half])]])[:count]
        if "reading" in scores:
            count = max(1, round(size * share["reading"]))
            reread = unseen_nearest(ctx, scores["reading"], count)
            picks = torch.cat([picks, reread[~torch.isin(reread, picks)]])
        if self._lm_order is not None:
            count = max(1, round(size * share["proposal"]))
            picks = torch.cat([picks, ctx.unseen(self._lm_order, count)]).unique()
        if rounds >= 2 and ctx.checked < self.explore_max:
            # the ranking missed: add unbiased samples (as many as we have) so the next fit is local
            extra = max(self.explore * ctx.scale, min(ctx.checked, self.explore_max - ctx.checked))
            picks = torch.cat([picks, remaining(ctx, ctx.generator, extra)]).unique()
        return picks

    def _reread_scores(self, ctx: PositionContext) -> torch.Tensor:
        """``[V]``: each input vector's squared distance (less a constant) to the reading of this position's observed
        state less the reading's mean error on this position's verified candidates (what it reads from their states
        minus their input vectors; attention sinks left out). Each verified
        candidate's state is read once (a network's forward costs ~6% of its verification's on SmolLM2)."""
        assert self._read is not None and self._observed is not None and self._vocab_sq is not None
        t = ctx.position
        if self._readings is None:  # not given by the engine's proposal
            self._readings = read(self._read, self._observed)
        total, count, used = self._misread
        ids, states = ctx.all_ids()[used:], ctx.all_states()[used:]
        keep = states.norm(dim=1) <= self.outlier * float(ctx.target.norm())
        if keep.any():
            vocab = ctx.probe.vocab_matrix(torch.float32)
            error = read(self._read, states[keep], self._observed[t - 1]) - vocab[ids[keep]]
            total = error.sum(0) if total is None else total + error.sum(0)
            count += int(keep.sum())
        self._misread = (total, count, used + len(ids))
        reading = self._readings[t] if total is None else self._readings[t] - total / count
        return self._vocab_sq - 2.0 * ctx.probe.vocab_dots(reading)

    def _stream_shares(self) -> dict[str, float]:
        """Each ranking's part of a later batch (secant, recentred reading, proposal order): the best by its record in
        this prompt gets all of ``size``, another ``2**-(its mean log2 rank - the best's)`` of it, at least
        :data:`STREAM_FLOOR` (so that it can recover); before any record, all of it each."""
        logs = self._stream_logs
        best = min(logs.values(), default=0.0)
        return {name: max(STREAM_FLOOR, 2.0 ** (best - logs[name])) if name in logs else 1.0 for name in STREAMS}

    def _trusted_size(self) -> int:
        """A trusted first batch: the next power of two above the worst rank the proposal gave the last ``RECENT``
        tokens, at most ``trusted`` (a verification forward of one candidate costs about half one of eight on a CPU,
        and at layer 1 of SmolLM2 the reading map's first guess is right at nearly every position)."""
        if len(self._recent) < RECENT:
            return self.trusted
        return min(self.trusted, 1 << max(self._recent).bit_length())

    def end_position(self, ctx: PositionContext) -> None:
        self._pool = [*self._pool, self._centred(ctx)][-self.memory :]
        if self.carried > 0 and self._J is not None and self._P_sq is not None and ctx.checked:
            self._carried = self._offset(ctx)  # the next position's first guess at its offset
        if self._lm_order is None:  # decided before the policy proposed (:mod:`.speculation`)
            self._take_order(ctx)  # the prior's record still learns from it

    def _take_order(self, ctx: PositionContext) -> None:
        """This position's proposal order: the sources' orders (the next-token prior's, the reading's) merged, each
        weighted by its recent record in this prompt (:data:`SOURCE_FLOOR` at least): where one keeps missing (the
        next-token prior on random token ids) the other's ranks are not diluted by it."""
        self._sources = ctx.next_tokens if self.lm_prior else None
        if self._sources is None:
            self._lm_order = None
            return
        if len(self._source_shares) != len(self._sources):
            self._source_shares = [1.0] * len(self._sources)
        self._lm_order = merge(self._sources, [max(SOURCE_FLOOR, share) for share in self._source_shares])

    def accepted(self, position: int, token_id: int) -> None:
        for name, ranking in self._first_scores.items():  # the token's rank in each of the position's first rankings
            if name == "proposal":
                found = (ranking == token_id).nonzero()
                rank = int(found[0, 0]) if len(found) else 2 * len(ranking)
            else:
                rank = int((ranking < ranking[token_id]).sum())
            record = math.log2(2 + rank)
            self._stream_logs[name] = 0.5 * self._stream_logs.get(name, record) + 0.5 * record
        self._first_scores = {}
        if self._sources is not None:
            depth = 4 * self.first
            hits = (self._sources[:, :depth] == token_id).any(dim=1).tolist()
            self._source_shares = [
                0.5 * share + 0.5 * hit for share, hit in zip(self._source_shares, hits, strict=True)
            ]
            self._sources = None
        if self._carried_order is not None:  # did the carried ranking have this token in its top few?
            hit = bool((self._carried_order[: self.carried] == token_id).any())
            self._carried_share = 0.5 * self._carried_share + 0.5 * hit
            self._carried_order = None
        if self._lm_order is not None:  # how well did the prior rank this token? (random ids: badly)
            found = (self._lm_order[: 4 * self.first] == token_id).nonzero()
            hit = len(found) > 0
            self._lm_share = 0.5 * self._lm_share + 0.5 * hit
            self._recent = [*self._recent, int(found[0, 0]) if hit else 4 * self.first][-RECENT:]
            self._lm_order = None


class SecantPolicy(LinearPolicy):
    """The linear policy without the next-token prior: the secant ranking alone (for comparison)."""

    name = "secant"

    def __init__(self, **settings) -> None:
        super().__init__(**{"lm_prior": False, "explore_max": 4096, **settings})
