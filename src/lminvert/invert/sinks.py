"""Positions after the first whose state is an attention sink: candidates ranked by the first-position table.

Some prompts turn a later position, usually position 1, into a second attention sink: its state's norm grows to tens
or a hundred times the other positions' (SmolLM2 layer 15: 28 of 400 random-id prompts and 17 of 400 text windows of 6
tokens at position 1, over 4 times the median of the positions after it; it depends on the first two tokens together,
not on either alone). The position-1 map is fitted without such states and the reading barely reads them, so the
engine verified thousands of candidates there (12 of those prompts cut to 3 tokens, layer 15: 257 to 21,536 at
position 1, 2-28 s a prompt). A sink attends mostly to itself, as position 0 does, so its state, run alone through the
blocks above its layer (:meth:`.tables.FirstTable.lift`), points nearly where its own token's first-position state
points (:meth:`SinkRanker._ranking`).

:class:`SinkRanker` ranks every token that way at such a position, and where the nearest stands clearly apart
(:data:`MARGIN`), that token leads the position's first batch (:class:`.linear.LinearPolicy`): one candidate, right
at most sinks where it leads; where it is wrong it costs that candidate, and the search after it may take another
course (one such position took 7,297 candidates against 4,666 without the lead). The rankers' order as a stream of
the later batches was tried beside it and not kept: its candidates misled the secant fit (docs/results.md). It only
orders candidates: each one is verified and the acceptor decides, so it changes speed, never an answer. Switch:
:data:`SINK_LEAD`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..models import Layer, LoadedModel, observed
from .rankers import Ranker, Ranking
from .reading import Reading
from .sources import ErrorModel
from .tables import FirstTable, first_table_for

SINK_LEAD = True  # put a sink's nearest first-position rows first (False: the rankers' order alone)
RATIO = 4.0  # a position is a sink where its state's norm is over this many times the median of the prompt's
# positions after the first (at least MEDIAN_OF of them)
MEDIAN_OF = 3
# the lead's score over the next token's from which it leads (SmolLM2, the sinks of 800 prompts of 6 tokens, each
# layer's kept or lifted-to table: it led at 18 of 51 at layer 15 and was right at 17; 19 of 36 at 30, right at 15;
# 77 of 111 at 8, right at 75; 34 of 50 at 22, right at 18)
MARGIN = 1.05
# a position's cached forwards run at the observer's shape (:func:`shaped`) where its state's norm is over this many
# times the median of the prompt's positions after the first (SmolLM2 in bfloat16, 104 prompts of 20 tokens: sinks
# 30-152x at layer 15 and 3.2-9.3x at layer 30, the other positions at most 1.7x and 2.5x; layer 6's largest 8-13x)
SHAPE_RATIO = 3.0
# states from elsewhere that a plain forward may give bit for bit (``float``) shaped too, at the rows' own length
# (SmolLM2 bfloat16 layer 30, a capture from a right-padded batch, sink at position 1: 53.0 against 288.2 s, with
# acceptor.REPRODUCED_RIVALS, one process; docs/results.md); False: lminvert's own states alone
SHAPE_ELSEWHERE = True
SHARED = 8  # the table's leading directions left out of the comparison (see SinkRanker._ranking)
SAMPLE = 8192  # table rows they are found from


class SinkRanker(Ranker):
    """At a sink (see the module docstring), the token whose first-position state lies nearest the lifted state in
    direction (:meth:`_ranking`), where it is nearer than the next by :data:`MARGIN`; elsewhere nothing. It leads the
    position's first batch."""

    name = "sink"

    def __init__(self) -> None:
        self.at: tuple[LoadedModel, Layer] | None = None  # where the table is read, once a prompt has a sink
        self.table: FirstTable | None = None
        self._orders: dict[int, torch.Tensor] = {}

    def prepare(self, model: LoadedModel, layer: Layer, first_table: bool, reading: Reading | None) -> None:
        self.at, self.table = ((model, layer) if SINK_LEAD and first_table else None), None

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None) -> None:
        self._orders = {}
        found = sinks(states) if self.at is not None else []
        if found and self.table is None:  # the table the engine ranks position 0 with (kept: read from memory)
            assert self.at is not None
            self.table = first_table_for(*self.at, progress=False)
        for t in found:
            best = (-self._ranking(states[t])).topk(2)
            first, second = float(best.values[0]), float(best.values[1])
            if first > 0 and first >= MARGIN * second:  # a ratio of scores: only where the nearest points this way
                self._orders[t] = best.indices[:1]

    def scores(self, ctx) -> Ranking | None:
        return self._orders.get(ctx.position)

    def _ranking(self, state: torch.Tensor) -> torch.Tensor:
        """``[V]``, smaller first: minus the cosine between each token's table row and ``state`` lifted (times the
        lifted residual's norm, the same for every row), the table's :data:`SHARED` leading directions taken out of
        both (every sink's row points almost the same way along them). SmolLM2 layer 15, the true token's row first at
        12 of 51 sinks by the plain cosine, 17 without them, and within 256 at 19 and 26; layer 30 (its own table) 6
        and 16 of 36 first (docs/results.md)."""
        table = self.table
        assert table is not None
        basis, norms = shared_directions(table)
        lifted = table.lift(state).to(table.table.device)
        residual = lifted - (lifted @ basis.T) @ basis
        return -(table.table @ residual) / norms


def shared_directions(table: FirstTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's :data:`SHARED` leading right singular vectors ``[SHARED, d]`` (of :data:`SAMPLE` rows drawn with a
    fixed seed) and the norms of its rows with them taken out ``[V]``, kept on the loaded model per table."""
    key = ("sink-directions", table.at.name, table.model.dtype)
    memo = table.model.memo
    if key not in memo:
        rows = table.table
        sample = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:SAMPLE].to(rows.device)]
        basis = torch.linalg.svd(sample.double(), full_matrices=False).Vh[:SHARED].to(rows.dtype)
        along = rows @ basis.T
        memo[key] = basis, (table.norms - along.square().sum(1)).clamp_min(1e-30).sqrt()
    return memo[key]


def sinks(states: torch.Tensor, ratio: float = RATIO) -> list[int]:
    """The positions after the first of a prompt's states ``[T, d]`` whose norm is over ``ratio`` times the median
    of those positions' norms (none where there are fewer than :data:`MEDIAN_OF`)."""
    if len(states) <= MEDIAN_OF:
        return []
    norms = states[1:].float().norm(dim=1)
    return [1 + int(i) for i in (norms > ratio * norms.median()).nonzero().flatten()]


def shaped(probe, prompts: Sequence[torch.Tensor], t: int, source: ErrorModel) -> contextlib.AbstractContextManager:
    """Where position ``t`` is sink-like in one of ``prompts`` (their observed states ``[T, d]``, one length; the norm
    over :data:`SHAPE_RATIO` times the median after position 0: :func:`sinks`) and ``source`` says the observer's
    forward is the prompt's own (:attr:`.sources.ErrorModel.reproducible`: its shape is known) or may be
    (:data:`SHAPE_ELSEWHERE`: states from elsewhere that a plain forward may give bit for bit,
    :attr:`.sources.ErrorModel.bitwise`, at the rows' own length, the likeliest shape), the cached forwards of
    the prompts' search there and of their prefixes' growth by the tokens decided there run at that shape
    (:func:`lminvert.models.observed.shaped`: a half-precision model on a CPU): a sink's state from a cached forward of
    another shape lies far from the observed one (SmolLM2 layer 30 in bfloat16: 69% of the norm), so the true token
    came among the last of the contenders re-measured. Speed only. Not everywhere: unpacked, shaped forwards cost more
    (a first version that also zero-filled the queries, shaped at every position: 1.14x the median on 12 held-out
    prompts, SmolLM2 bfloat16 layer 15), and where the unshaped state was near they change the rankers' order
    (docs/results.md: one sink prompt of five at layer 15 took 30.1 s against 6.5 s)."""
    lengths = {len(states) for states in prompts}
    known = source.reproducible or (SHAPE_ELSEWHERE and source.bitwise)  # the observer's shape, or the likeliest
    if not known or len(lengths) != 1 or not any(t in sinks(states, SHAPE_RATIO) for states in prompts):
        return contextlib.nullcontext()
    return observed.shaped(probe, lengths.pop())
