"""The model's own next-token ranking after the recovered prefix: a proposal model that costs nothing extra.

At position ``t`` the prefix ``s_0..s_{t-1}`` is already recovered, so the inverted model itself says which tokens
are likely next (the idea of "Hidden No More": rank candidates with a language model). Where the states are the
last block's (layer ``L``) or the final norm's, the logits come straight from the observed state of position
``t - 1``: no forward at all. At other layers the full model runs over the recovered prefix, one token per
position, with its own KV cache: one batched forward per position for all the prompts inverted together.

The ranking only orders candidates: every candidate is still verified, so a poor prior (random token ids) costs
time, never exactness. Logits are ranked in float32 whatever the model's precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models import Layer, LoadedModel


class NextTokenPrior:
    """Next-token orders for the positions of N prompts advanced together, fed the recovered tokens."""

    def __init__(self, model: LoadedModel, layer: Layer, observed: Sequence[torch.Tensor], depth: int = 2048) -> None:
        self.probe = model.probe
        self.layer = layer
        self.observed = list(observed)  # per prompt [T_i, d]
        self.rows = list(range(len(self.observed)))  # which prompts are still being advanced
        self.depth = min(depth, self.probe.vocab_size)
        self.direct = layer.is_final or int(layer) == self.probe.n_layers
        self._full = None if self.direct else self.probe.prefixes([[]] * len(self.observed), self.probe.layer(-1))
        self._last: torch.Tensor | None = None  # [rows, d] states of the last recovered tokens (not direct)

    def orders(self, position: int) -> torch.Tensor | None:
        """``[rows, depth]``: the most likely next tokens of each prompt still advanced (most likely first), on the
        model's device; None at position 0."""
        if position == 0:
            return None
        if self.direct:
            state = torch.stack([self.observed[i][position - 1] for i in self.rows])
            logits = self.probe.next_token_logits(state, normed=self.layer.is_final)
        else:
            assert self._last is not None, "advance() the prior with each recovered token"
            logits = self.probe.next_token_logits(self._last)
        return logits.float().topk(self.depth, dim=-1).indices

    def select(self, keep: Sequence[int]) -> None:
        """Only prompts ``keep`` (indices into the current rows) are advanced from now on."""
        self.rows = [self.rows[k] for k in keep]
        if self._full is not None:
            self._full = self.probe.select(self._full, keep)
            if self._last is not None:
                self._last = self._last[torch.as_tensor(list(keep), device=self._last.device)]

    def advance(self, token_ids: Sequence[int]) -> None:
        """Each prompt's recovered prefix grew by its token (one forward for all of them)."""
        if self._full is not None:
            self._full, self._last = self.probe.advance_rows(self._full, token_ids)

    def order(self, position: int) -> torch.Tensor | None:
        """The order of a single prompt (one row)."""
        orders = self.orders(position)
        return None if orders is None else orders[0]
