"""Whether a chosen token's own state is sink-like, for a rows search of a leak computed elsewhere: such a state (a
few huge coordinates) amplifies the kernels that computed it, so its row does not choose among tokens by separation
(:attr:`lminvert.invert.acceptor.Radii.fragile`). A row (a KV cache's keys and values of a sink are small, not large)
does not say it; the token's state at the layer the view reads does, against the ``float`` model's sink-like bands
(:class:`lminvert.invert.layouts.Disagreement`)."""

from __future__ import annotations

import torch

from ...models import Layer, LoadedModel
from ..engine import bound_source
from ..sources import ErrorModel, Float
from .memo import StateMemo

POOL = 1024  # random prompts drawn for :meth:`SinkLike.prompts` (SmolLM2: 4-7% of them have a sink at position 1)
SEED = 4242


class SinkLike:
    """Sink-likeness of candidates' states at ``layer`` of ``model`` (the bands measured once, on first use)."""

    def __init__(self, model: LoadedModel, layer: Layer) -> None:
        self.model, self.layer = model, layer
        self._bands: ErrorModel | None = None

    @property
    def bands(self) -> ErrorModel:
        """The ``float`` model at this layer, its sink-like bands measured."""
        if self._bands is None:
            self._bands = bound_source(self.model, self.layer, Float())
        return self._bands

    def fragile(self, prefix: list[int], token: int, memo: StateMemo | None = None) -> bool:
        """Whether ``token``'s state after ``prefix`` lies in a band wider than the later positions' disagreement
        (position 0 never: it is computed alone); the state from ``memo`` where the search kept it, else one forward."""
        if not prefix or not self.bands.bands:
            return False
        probe = self.model.probe

        def compute(ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                states = probe.continuation(probe.prefix(prefix, self.layer), ids.to(probe.device))
            assert isinstance(states, torch.Tensor)
            return states

        ids = torch.tensor([token])
        return self.bands.fragile((compute(ids) if memo is None else memo.states(prefix, ids, compute))[0], len(prefix))

    def prompts(self, count: int, length: int = 3) -> list[list[int]]:
        """Up to ``count`` prompts of ``length`` random tokens (``POOL`` drawn, seed ``SEED``) whose position 1 is
        sink-like at this layer (none where the bands are empty)."""
        if not self.bands.bands:
            return []
        probe, found = self.model.probe, []
        pool = torch.randint(0, probe.vocab_size, (POOL, length), generator=torch.Generator().manual_seed(SEED))
        for chunk in pool.split(64):
            with torch.no_grad():
                states = probe.states(chunk.to(probe.device), [self.layer])[self.layer].float().cpu()
            found += [ids.tolist() for ids, s in zip(chunk, states, strict=True) if self.bands.fragile(s[1], 1)]
            if len(found) >= count:
                break
        return found[:count]
