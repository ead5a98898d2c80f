"""Whether a chosen token's own state is sink-like, for a rows search of a leak computed elsewhere: such a state (a
few huge coordinates) amplifies the kernels that computed it, so its row does not choose among tokens by separation
(:attr:`lminvert.invert.acceptor.Radii.fragile`). A row (a KV cache's keys and values of a sink are small, not large)
does not say it; the token's state at the layer the view reads does, against the ``float`` model's sink-like bands
(:class:`lminvert.invert.layouts.Disagreement`)."""

from __future__ import annotations

import torch

from ...models import Layer, LoadedModel
from ..layouts import foreign_calibration
from ..sources import ErrorModel, Float


class SinkLike:
    """Sink-likeness of candidates' states at ``layer`` of ``model`` (the bands measured once, on first use)."""

    def __init__(self, model: LoadedModel, layer: Layer) -> None:
        self.model, self.layer = model, layer
        self._bands: ErrorModel | None = None

    def fragile(self, prefix: list[int], token: int) -> bool:
        """Whether ``token``'s state after ``prefix`` (one forward) lies in a band wider than the later positions'
        disagreement (position 0 never: it is computed alone)."""
        if not prefix:
            return False
        if self._bands is None:
            measured = foreign_calibration(self.model, self.layer)
            self._bands = Float().calibrated(measured.first, measured.rest, measured.bands)
        if not self._bands.bands:
            return False
        probe = self.model.probe
        with torch.no_grad():
            states = probe.continuation(probe.prefix(prefix, self.layer), torch.tensor([token], device=probe.device))
        assert isinstance(states, torch.Tensor)
        return self._bands.fragile(states[0], len(prefix))
