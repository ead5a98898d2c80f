"""The candidate policy's contract (:class:`Policy`) and the small helpers every policy ranks with: which ids of a
position are unseen, and the lowest entries of a score over the vocabulary."""

from __future__ import annotations

import torch

from ..models import Layer, LoadedModel
from .context import PositionContext
from .reading import Reading


class Policy:
    """Base class: subclasses implement :meth:`propose`; :meth:`begin` / :meth:`end` are optional hooks.

    A policy instance serves one prompt at a time; when several prompts are inverted together each has its own.
    """

    name = "base"
    uses_first_table = False
    uses_next_tokens = False  # the engine then fills ``ctx.next_tokens`` (the model's own next-token order)
    uses_reading = False  # ... beside the reading's order (:mod:`.reading`), as a second source
    fused = 0.0  # ... and, above 0, a third: both sources' scores summed, the reading's times this (:mod:`.proposal`)
    fit_fused = False  # ... that weight replaced by the one fitted for the layer's reading (:mod:`.fusion`)

    def prepare(
        self, model: LoadedModel, layer: Layer, first_table: bool = True, reading: Reading | None = None
    ) -> None:
        """Called once before inverting with ``model`` at ``layer`` (load cached priors here); ``first_table``:
        position 0 is decided by the first-position table; ``reading``: the map or network the proposal reads each
        position's token with (when :attr:`uses_reading`)."""

    def begin_prompt(self, states: torch.Tensor, readings: torch.Tensor | None = None) -> None:
        """Called before the first position of each prompt, with its observed states ``[T, d]`` and, when the engine
        computed them for the proposal, what the reading reads from each (``[T, d]``: ``NextTokenPrior.readings``)."""

    def propose(self, ctx: PositionContext) -> torch.Tensor | None:
        raise NotImplementedError

    def end_position(self, ctx: PositionContext) -> None:
        """Called when a position this policy searched is decided (policies may keep what they learnt)."""

    def accepted(self, position: int, token_id: int) -> None:
        """Called after every position (the table's too): the recovered prefix grew by ``token_id``."""


def remaining(ctx: PositionContext, generator: torch.Generator | None, batch: int) -> torch.Tensor:
    """Next ``batch`` unseen ids in random (or index) order."""
    unseen = (~ctx.seen).nonzero().squeeze(1)
    if generator is not None:  # the generator lives on the CPU: the same draws on every device
        unseen = unseen[torch.randperm(len(unseen), generator=generator).to(unseen.device)]
    return unseen[:batch]


def nearest(score: torch.Tensor, top: int) -> torch.Tensor:
    """The ``top`` lowest entries of ``score`` ``[V]``, lowest first (a partial sort unless that is half of it)."""
    return score.argsort() if top >= len(score) // 2 else score.topk(top, largest=False).indices


def unseen_nearest(ctx: PositionContext, score: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` entries of lowest ``score`` ``[V]`` not verified yet at this position, lowest first."""
    return ctx.unseen(nearest(score, count + ctx.checked), count)
