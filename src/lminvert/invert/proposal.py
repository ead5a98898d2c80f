"""The model's own next-token ranking after the recovered prefix: a proposal model that costs nothing extra.

At position ``t`` the prefix ``s_0..s_{t-1}`` is already recovered, so the inverted model itself says which tokens
are likely next (the idea of "Hidden No More": rank candidates with a language model). Where the states are the
last block's (layer ``L``) or the final norm's, the logits come straight from the observed state of position
``t - 1``: no forward at all. At other layers the full model runs over the recovered prefix, one token per
position, with its own KV cache.

The ranking only orders candidates; every candidate is still verified, so a poor prior (random token ids) costs
time, never exactness.
"""

from __future__ import annotations

import torch

from ..models import Layer, LoadedModel


class NextTokenPrior:
    """Next-token order for each position of one prompt, fed the recovered tokens as they are decided."""

    def __init__(self, model: LoadedModel, layer: Layer, observed: torch.Tensor, depth: int = 2048) -> None:
        self.probe = model.probe
        self.layer = layer
        self.observed = observed
        self.depth = min(depth, self.probe.vocab_size)
        self.direct = layer.is_final or int(layer) == self.probe.n_layers
        self._full = None if self.direct else self.probe.prefix([], self.probe.layer(-1))
        self._last_state: torch.Tensor | None = None

    def order(self, position: int) -> torch.Tensor | None:
        """The ``depth`` most likely next tokens at ``position`` (most likely first); None at position 0."""
        if position == 0:
            return None
        if self.direct:
            logits = self.probe.next_token_logits(self.observed[position - 1], normed=self.layer.is_final)
        else:
            assert self._last_state is not None, "advance() the prior with each recovered token"
            logits = self.probe.next_token_logits(self._last_state)
        return logits.float().topk(self.depth).indices.cpu()

    def advance(self, token_id: int) -> None:
        """The recovered prefix grew by ``token_id``."""
        if not self.direct:
            assert self._full is not None
            self._full, self._last_state = self.probe.advance(self._full, token_id)
