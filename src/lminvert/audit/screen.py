"""Screening in the rows search (:class:`Screen`): a later batch of a position, ``SCREEN_FROM`` candidates or more,
first runs with bfloat16 GEMMs (:meth:`lminvert.models.LayerProbe.screening`: a float32 model on a CPU with native
bfloat16 GEMMs), as the engine's search screens (:mod:`lminvert.invert.search`). Only the candidates whose screened row
lies within the screening radius of the target are verified in full and shown to the acceptor; the others are screened
out (:class:`Screened`): never shown to it, counted as checked, and verified in full before the position could be
called swept (every token verified). The rankers see every row, screened ones included (they only order candidates).

The radius covers every candidate the acceptor compares: a contender lies within the plain radius of the target, a
rival of one within ``SLACK`` plain radii more (:func:`lminvert.invert.acceptor.margin`), so every candidate whose full
row could lie within ``1 + SLACK`` plain radii is verified in full, the screened rows' own error allowed for as
``SAFETY`` times its measured relative size (:func:`.calibration.measure`). Screening thus changes no certified or
confident verdict, as far as that measurement bounds the error; it may change which token an ``uncertain`` position
guesses where nothing fits (the nearest of the candidates verified in full).
"""

from __future__ import annotations

import torch

from ..invert.acceptor import SLACK
from ..invert.tolerance import FLOOR, SAFETY, norm
from ..invert.verification import SCREEN_FROM
from ..models import LoadedModel, Prefix


class Screen:
    """A model's screened forward and its measured relative error in the rows' space (``relative``: the largest
    ``||screened row - plain row|| / ||plain row||`` of the calibration prompts' true tokens)."""

    def __init__(self, model: LoadedModel, relative: float) -> None:
        self.probe, self.relative = model.probe, relative

    @staticmethod
    def applies(size: int) -> bool:
        """Whether a batch of ``size`` candidates is screened (smaller ones save too little to pay for the full
        forward of their picks)."""
        return size >= SCREEN_FROM

    def radius(self, target: torch.Tensor, plain: float) -> float:
        """Screened rows farther than this from ``target`` are screened out (see the module docstring)."""
        return (1 + SLACK) * plain + SAFETY * max(self.relative, FLOOR) * norm(target)

    def states(self, prefix: Prefix, ids: torch.Tensor) -> torch.Tensor:
        """The screened states ``[n, d]`` of candidates ``ids`` over ``prefix`` (float32)."""
        with torch.no_grad(), self.probe.screening():
            return self.probe.continuation(prefix, ids.to(self.probe.device)).float()


class Screened:
    """One position's screened-out candidates: their ids and screened distances, until verified in full."""

    def __init__(self, radius: float) -> None:
        self.radius = radius
        self.ids: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.count = 0  # screened out and not verified in full since

    def add(self, ids: torch.Tensor, dists: torch.Tensor) -> None:
        self.ids.append(ids)
        self.dists.append(dists)
        self.count += len(ids)

    def take(self) -> torch.Tensor:
        """Every screened-out candidate, the nearest first (to be verified in full now)."""
        ids, dists = torch.cat(self.ids), torch.cat(self.dists)
        self.ids, self.dists, self.count = [], [], 0
        return ids[dists.argsort()]
