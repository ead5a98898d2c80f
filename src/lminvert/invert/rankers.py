"""Rankers: each orders the vocabulary at a position from one source of evidence; :class:`.linear.LinearPolicy` mixes
them by their record in the prompt.

A ranker's one question is :meth:`Ranker.scores`: given the position's context, a :data:`Ranking` over the
vocabulary, or None where it has nothing to say yet. A ranking is either float scores ``[V]`` (lowest first) or an
order of token ids (most likely first, possibly shorter than the vocabulary). Rankers only order candidates: the
engine verifies every candidate, so a ranker changes speed, never the answer.

* :class:`SecantRanker` (``secant``) - the secant linear model ``h(v) ~ a + e_v J`` of the position, fitted by ridge
  regression on the verified (input vector, state) pairs of this position and the last ``memory`` ones;
* :class:`LocalRanker` (``local``) - the same model fitted on this position's pairs alone;
* :class:`CarriedRanker` (``carried``) - the secant model with the previous position's offset ``a`` (before this
  position has pairs of its own);
* :class:`OrderRanker` (``next-token``, ``reading``, ``fused``) - an order the engine computed before the search
  (``ctx.next_tokens``): the model's own next-token prediction from the observed states, what the position's own
  state reads as, and the two combined as a product of experts (:mod:`.proposal`, :mod:`.reading`);
* :class:`RereadRanker` (``reread``) - the reading of the observed state less the reading's mean error on this
  position's verified candidates.

To add one: subclass :class:`Ranker` here (a frozen settings dataclass if it has settings) and list it in
:data:`EXTRA`: the linear policy then draws part of every later batch from it, by its record in the prompt like the
others', and ``benchmarks/bench_rank_quality.py`` reports the recovered token's place under it at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import Layer, LoadedModel
from .context import PositionContext, wide_dtype
from .policy import unseen_nearest
from .reading import Reading, read
from .secant import centre, fit_secant_map, projected_norms
from .tables import position1_projection, squared_norms

Ranking = torch.Tensor  # float scores [V] (lowest first) or int token ids (most likely first)


def top_unseen(ctx: PositionContext, ranking: Ranking, count: int) -> torch.Tensor:
    """The first ``count`` ids of ``ranking`` not verified yet at this position, best first."""
    if ranking.is_floating_point():
        return unseen_nearest(ctx, ranking, count)
    return ctx.unseen(ranking, count)


def rank_of(ranking: Ranking, token_id: int) -> int:
    """``token_id``'s place in ``ranking`` (0: first); an order that does not hold it: twice its length."""
    if ranking.is_floating_point():
        return int((ranking < ranking[token_id]).sum())
    found = (ranking == token_id).nonzero()
    return int(found[0, 0]) if len(found) else 2 * len(ranking)


class Ranker:
    """Contract: :meth:`scores`; the hooks are optional. One instance serves one prompt at a time."""

    name = "ranker"

    def prepare(self, model: LoadedModel, layer: Layer, first_table: bool, reading: Reading | None) -> None:
        """Once per model and layer (see :meth:`.policy.Policy.prepare`)."""

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None) -> None:
        """Before a prompt's first position, with its observed states ``[T, d]`` (and their readings, if computed)."""

    def begin_position(self, ctx: PositionContext) -> None:
        """Before a position's first candidates."""

    def scores(self, ctx: PositionContext) -> Ranking | None:
        raise NotImplementedError

    def end_position(self, ctx: PositionContext) -> None:
        """When the position is decided (keep what was learnt)."""


@dataclass(frozen=True)
class FitSettings:
    """The secant fit's settings (why each default: docs/history.md, "The linear policy's settings").

    ``memory``: previous positions whose pairs join the fit; ``ridge``: ridge penalty and ``prior``: pull towards the
    previous ``J``, both relative to the data's energy; ``outlier``: states with a norm above ``outlier`` times the
    target's (attention sinks) are left out; ``fresh``: with this many pairs at the position, fit on them alone (no
    memory, no pull); ``norm_rank``: the ranking's row norms ``||e_v J||^2`` from the top ``norm_rank`` eigenpairs of
    ``J J^T`` (:func:`.secant.projected_norms`); ``local_from``: from this many pairs at the position (below
    ``fresh``), also fit on them alone for :class:`LocalRanker` (0: never).
    """

    memory: int = 2
    ridge: float = 1e-3
    prior: float = 0.05
    outlier: float = 4.0
    fresh: int = 512
    norm_rank: int = 64
    local_from: int = 64


def _inliers(ctx: PositionContext, states: torch.Tensor, outlier: float) -> torch.Tensor:
    """Which states are not attention sinks (a norm within ``outlier`` times the target's)."""
    return states.norm(dim=1) <= outlier * float(ctx.target.norm())


class SecantRanker(Ranker):
    """Predicted distance ``||a + e_v J - h||^2`` (less a constant) of every input vector's state to the target ``h``.

    ``J`` comes from the position-1 map at first (when the first-position table decides position 0), then from
    ridge fits refitted whenever the position's verified pairs doubled (:meth:`refit_due`); the offset ``a`` is the
    mean of ``h - e_v J`` over the position's verified pairs. Runs in float32 (the fits in float64) whatever the
    model's precision."""

    name = "secant"

    def __init__(self, settings: FitSettings = FitSettings()) -> None:
        self.settings = settings
        self.jac: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None  # ||e_v J||^2 [V]
        self.local: tuple[torch.Tensor, torch.Tensor] | None = None  # (J, norms) of this position's pairs alone
        self._pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last positions' centred pairs
        self._prior: tuple[torch.Tensor, torch.Tensor] | None = None  # (J, norms) at position 1
        self._vocab_sq: torch.Tensor | None = None
        self._fitted_on = 0  # candidates of this position when last fitted

    def prepare(self, model: LoadedModel, layer: Layer, first_table: bool, reading: Reading | None) -> None:
        self._vocab_sq = squared_norms(model, "vocabulary", model.probe.vocab_matrix(torch.float32))
        self._prior = position1_projection(model, layer) if first_table else None

    def start_from(self, prior: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Every prompt's first fit: ``(J, ||e_v J||^2 for every v)`` (a view's position-1 map,
        :func:`.tables.position1_projection`) instead of the one :meth:`prepare` chose."""
        self._prior = prior

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None) -> None:
        self._pool = []
        self.jac, self._norms = self._prior if self._prior is not None else (None, None)

    def begin_position(self, ctx: PositionContext) -> None:
        self._fitted_on, self.local = 0, None

    def centred(self, ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This position's centred (input vector, state) pairs, attention sinks left out (they would dominate a
        least-squares fit: norms ~100x the others, e.g. at position 1 of SmolLM2)."""
        wide = wide_dtype(ctx.device)
        x = ctx.probe.vocab_matrix(torch.float32)[ctx.all_ids()].to(wide)
        h = ctx.all_states().to(wide)
        keep = _inliers(ctx, h, self.settings.outlier)
        return centre(x[keep], h[keep])

    def refit_due(self, ctx: PositionContext) -> bool:
        """No model yet, or this position's verified candidates doubled since the last fit (after its first round)."""
        return self.jac is None or (ctx.rounds >= 2 and ctx.checked >= 2 * self._fitted_on)

    def fit(self, ctx: PositionContext) -> None:
        """Refit ``J`` (and its row norms: the refit's whole cost), and :attr:`local` where it is due."""
        assert self._vocab_sq is not None, "prepare() first"
        s = self.settings
        x, h = self.centred(ctx)
        alone = len(x) >= s.fresh  # enough data here: fit this position alone
        vocab, low = ctx.probe.vocab_matrix(torch.float32), ctx.probe.low_vocab()
        if alone:
            self.local = None
        else:
            if s.local_from and len(x) >= s.local_from:  # a second opinion from this position alone
                jac = fit_secant_map(x, h, ridge=s.ridge)
                self.local = (jac, projected_norms(vocab, self._vocab_sq, jac, s.norm_rank, low))
            x = torch.cat([x, *(p[0] for p in self._pool)])
            h = torch.cat([h, *(p[1] for p in self._pool)])
        prior = None if alone else self.jac
        self.jac = fit_secant_map(x, h, ridge=s.ridge, prior=prior, prior_weight=s.prior)
        self._norms = projected_norms(vocab, self._vocab_sq, self.jac, s.norm_rank, low)
        self._fitted_on = ctx.checked

    def offset(self, ctx: PositionContext, jac: torch.Tensor | None = None) -> torch.Tensor:
        """The offset ``a`` at this position (of ``J`` unless ``jac``): the mean of ``h - e_v J`` over its verified
        pairs (attention sinks left out, unless all are)."""
        jac = self.jac if jac is None else jac
        assert jac is not None
        ids, states = ctx.all_ids(), ctx.all_states().float()
        keep = _inliers(ctx, states, self.settings.outlier)
        if keep.any():
            ids, states = ids[keep], states[keep]
        return (states - ctx.probe.vocab_matrix(torch.float32)[ids] @ jac.float()).mean(0)

    def distances(
        self,
        ctx: PositionContext,
        offset: torch.Tensor | None = None,
        model: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[V]``: ``||a + e_v J - h||^2 - ||h - a||^2`` (``a``: this position's offset unless given; ``J`` and its row
        norms: the fit's unless ``model`` gives them)."""
        jac, norms = (self.jac, self._norms) if model is None else model
        assert jac is not None and norms is not None
        residual = ctx.target.float() - (self.offset(ctx, jac) if offset is None else offset)
        return norms - 2.0 * ctx.probe.vocab_dots(jac.float() @ residual)

    def scores(self, ctx: PositionContext) -> Ranking | None:
        return None if self.jac is None else self.distances(ctx)

    def end_position(self, ctx: PositionContext) -> None:
        self._pool = [*self._pool, self.centred(ctx)][-self.settings.memory :]


class LocalRanker(Ranker):
    """The secant model fitted on this position's pairs alone (:attr:`SecantRanker.local`, from ``local_from`` pairs
    until ``fresh``): a second opinion where the previous positions' pairs mislead the shared fit."""

    name = "local"

    def __init__(self, secant: SecantRanker) -> None:
        self.secant = secant

    def scores(self, ctx: PositionContext) -> Ranking | None:
        local = self.secant.local
        return None if local is None else self.secant.distances(ctx, model=local)


class CarriedRanker(Ranker):
    """The secant model with the previous position's offset: a ranking before this position has any pairs."""

    name = "carried"

    def __init__(self, secant: SecantRanker) -> None:
        self.secant = secant
        self._offset: torch.Tensor | None = None

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None) -> None:
        self._offset = None

    def scores(self, ctx: PositionContext) -> Ranking | None:
        if self._offset is None or self.secant.jac is None:
            return None
        return self.secant.distances(ctx, self._offset)

    def end_position(self, ctx: PositionContext) -> None:
        if self.secant.jac is not None and ctx.checked:
            self._offset = self.secant.offset(ctx)  # the next position's first guess at its offset


class OrderRanker(Ranker):
    """Row ``row`` of the orders the engine computed before the search (``ctx.next_tokens``: the next-token prior's,
    then the reading's, then both fused); None where the engine computed fewer."""

    def __init__(self, name: str, row: int) -> None:
        self.name, self.row = name, row

    def scores(self, ctx: PositionContext) -> Ranking | None:
        orders = ctx.next_tokens
        return None if orders is None or len(orders) <= self.row else orders[self.row]


class RereadRanker(Ranker):
    """Each input vector's squared distance (less a constant) to the reading of this position's observed state less
    the reading's mean error on this position's verified candidates (what it reads from their states minus their
    input vectors; attention sinks left out). Each verified candidate's state is read once (a reading network's
    forward costs ~6% of its verification's on SmolLM2)."""

    name = "reread"

    def __init__(self, outlier: float = FitSettings.outlier) -> None:
        self.outlier = outlier
        self.reading: Reading | None = None
        self.vocab_sq: torch.Tensor | None = None
        self._observed: torch.Tensor | None = None  # the prompt's observed states [T, d]
        self._readings: torch.Tensor | None = None  # what the reading reads from them [T, d] (when first needed)
        self._misread: tuple[torch.Tensor | None, int, int] = (None, 0, 0)  # this position: the sum of (read - e_v)
        # over the candidates read, how many, how many verified pairs were looked at

    def prepare(self, model: LoadedModel, layer: Layer, first_table: bool, reading: Reading | None) -> None:
        self.reading = reading
        self.vocab_sq = squared_norms(model, "vocabulary", model.probe.vocab_matrix(torch.float32))

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None) -> None:
        self._observed, self._readings = states, readings

    def begin_position(self, ctx: PositionContext) -> None:
        self._misread = (None, 0, 0)

    def scores(self, ctx: PositionContext) -> Ranking | None:
        if self.reading is None or ctx.position == 0:
            return None
        assert self._observed is not None and self.vocab_sq is not None
        t = ctx.position
        if self._readings is None:  # not given by the engine's proposal
            self._readings = read(self.reading, self._observed)
        total, count, used = self._misread
        ids, states = ctx.all_ids()[used:], ctx.all_states()[used:]
        keep = _inliers(ctx, states, self.outlier)
        if keep.any():
            vocab = ctx.probe.vocab_matrix(torch.float32)
            error = read(self.reading, states[keep], self._observed[t - 1]) - vocab[ids[keep]]
            total = error.sum(0) if total is None else total + error.sum(0)
            count += int(keep.sum())
        self._misread = (total, count, used + len(ids))
        reading = self._readings[t] if total is None else self._readings[t] - total / count
        return self.vocab_sq - 2.0 * ctx.probe.vocab_dots(reading)


# the built-in ones, as the policy has them
RANKERS = ("secant", "local", "carried", "next-token", "reading", "fused", "reread", "sink")
# rankers added to the linear policy's later batches (one instance per policy, made with no arguments)
EXTRA: tuple[type[Ranker], ...] = ()
