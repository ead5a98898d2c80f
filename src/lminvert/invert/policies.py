"""Candidate policies: in which order to verify vocabulary entries at a position.

A policy proposes batches of token ids; the engine verifies each batch with one cached forward and
records the distances in the :class:`PositionContext`, which the policy may use for its next proposal.
Every policy ends by proposing the whole remaining vocabulary, so Theorem 3.1's T*|V| bound holds.

* ``RandomPolicy`` - random order (the paper's BruteForce baseline).
* ``GradientPolicy`` - the paper's SIPIT policy: optimise a continuous input vector so its state matches the
  target (Adam, relative loss, several restarts in one batch), verify the vocabulary entries nearest to it.
* ``LinearPolicy`` (:mod:`.linear`) - the default: a secant (least-squares) linear model of the position's map
  from input embeddings to states, fitted from the candidates already verified (reused from the previous
  positions, refined at this one), ranks the vocabulary by predicted distance to the target.
* ``SweepPolicy`` - every id in order; with ``exhaustive=True`` in the engine this is the brute-force oracle.

Position 0 has no prefix: policies that can use it rank it with a first-position table (:class:`TablePolicy`).
"""

from __future__ import annotations

import torch

from .context import PositionContext
from .linear import LinearPolicy, SecantPolicy
from .policy import Policy, remaining
from .tables import FirstTable


class SweepPolicy(Policy):
    """All ids in index order, in large batches."""

    name = "sweep"

    def __init__(self, batch: int = 1024) -> None:
        self.batch = batch

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        return remaining(ctx, None, self.batch)


class RandomPolicy(Policy):
    """Random order (the paper's BruteForce); batches grow from ``first`` to ``batch``."""

    name = "random"

    def __init__(self, batch: int = 1024, first: int = 64) -> None:
        self.batch, self.first = batch, first

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        size = min(self.batch, self.first * 2**ctx.rounds)
        return remaining(ctx, ctx.generator, size)


class TablePolicy(Policy):
    """Position 0 only: the first-position table's rows closest to the target in angle (in half precision the table,
    computed one token per sequence, differs from the observer's state most in its norm: the acceptor orders
    contenders the same way, :func:`.acceptor.contenders`); a table of a layer above the target's ranks the target
    lifted there (:class:`.tables.FirstTable`)."""

    name = "table"

    def __init__(self, first_table: FirstTable, first: int = 8, batch: int = 1024) -> None:
        self.tables, self.first, self.batch = first_table, first, batch
        self._order: torch.Tensor | None = None

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        if not ctx.rounds:  # by angle (one matrix-vector product), not distance: see acceptor.contenders
            tables = self.tables
            score = tables.table @ tables.lift(ctx.target).to(tables.table.device)
            self._order = score.div_(tables.norms.sqrt().clamp_min(1e-30)).argsort(descending=True)
        assert self._order is not None
        size = min(self.batch, self.first * 4**ctx.rounds) * ctx.scale
        return ctx.unseen(self._order, size)


class GradientPolicy(Policy):
    """The paper's policy: gradient descent on a continuous input vector, verify the nearest entries.

    Between verification batches it takes ``steps`` Adam steps on ``restarts`` vectors at once (relative
    L2 loss ``||f(x) - h||^2 / ||h||^2``), then proposes the unverified entries nearest to any of them.
    """

    name = "gradient"
    uses_first_table = True

    def __init__(
        self,
        steps: int = 10,
        restarts: int = 4,
        lr: float = 0.05,
        per_round: int = 16,
        max_rounds: int = 40,
        batch: int = 1024,
    ) -> None:
        self.steps, self.restarts, self.lr = steps, restarts, lr
        self.per_round, self.max_rounds, self.batch = per_round, max_rounds, batch
        self._x: torch.Tensor | None = None
        self._opt: torch.optim.Optimizer | None = None

    def _start(self, ctx: PositionContext) -> None:
        vocab = ctx.probe.vocab_matrix(torch.float32)
        pick = torch.randint(0, len(vocab), (self.restarts - 1,), generator=ctx.generator).to(vocab.device)
        init = torch.cat([vocab.mean(0, keepdim=True), vocab[pick]])
        self._x = init.clone().requires_grad_(True)
        self._opt = torch.optim.Adam([self._x], lr=self.lr)

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        rounds = ctx.rounds
        if rounds >= self.max_rounds:
            return remaining(ctx, ctx.generator, self.batch)
        if rounds == 0:
            self._start(ctx)
        assert self._x is not None and self._opt is not None
        target = ctx.target.to(ctx.probe.dtype)
        scale = target.float().square().sum()
        for _ in range(self.steps):
            self._opt.zero_grad()
            out = ctx.continuation(embeds=self._x)
            loss = (out.float() - target.float()).square().sum(dim=-1).div(scale).sum()
            loss.backward()
            self._opt.step()
        with torch.no_grad():
            dist = torch.cdist(self._x.detach().float(), ctx.probe.vocab_matrix(torch.float32))  # [R, V]
            dist[:, ctx.seen] = float("inf")
            k = max(1, self.per_round // self.restarts)
            picks = dist.topk(k, dim=1, largest=False).indices.reshape(-1).unique()
        return picks


POLICIES = {"linear": LinearPolicy, "secant": SecantPolicy, "gradient": GradientPolicy, "random": RandomPolicy}
__all__ = ["POLICIES", "GradientPolicy", "LinearPolicy", "Policy", "RandomPolicy", "SecantPolicy", "SweepPolicy"]
__all__ += ["TablePolicy"]
