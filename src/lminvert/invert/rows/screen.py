"""Screening in the rows search (:class:`Screen`): a later batch of a position, ``SCREEN_FROM`` candidates or more,
first runs with bfloat16 GEMMs (:meth:`lminvert.models.LayerProbe.screening`: a float32 model on a CPU with native
bfloat16 GEMMs), as the engine's search screens (:mod:`lminvert.invert.search`). Only the candidates whose screened row
lies within the screening radius of the target are verified in full and shown to the acceptor; the others are screened
out (:class:`Screened`): never shown to it, counted as checked, and verified in full before the position could be
called swept (every token verified); where nothing fits, those that could lie nearer than the nearest candidate verified
in full are verified before it is taken as the guess. The rankers see every row, screened ones included (they only
order candidates).

The radius covers every candidate the acceptor compares: a contender lies within the plain radius of the target, a
rival of one within ``SLACK`` plain radii more (:func:`lminvert.invert.acceptor.margin`), so every candidate whose full
row could lie within ``1 + SLACK`` plain radii is verified in full, the screened rows' own error allowed for as
``SAFETY`` times its measured relative size (:meth:`.calibration.Calibration.screened`, on the first batch screened).
Screening thus changes no certified or confident verdict, nor the nearest candidate an ``uncertain`` position takes
where nothing fits, as far as that measurement bounds the error.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ...models import LayerProbe, LoadedModel, Prefix
from ..acceptor import SLACK
from ..tolerance import FLOOR, SAFETY, norm
from ..verification import SCREEN_FROM
from .verified import Distances


class Screen:
    """A model's screened forward and its relative error in the rows' space (``relative``: measured on first use, by
    ``measure``: the largest ``||screened row - plain row|| / ||plain row||`` of the calibration prompts' true
    tokens; a search that screens no batch never measures it)."""

    def __init__(self, model: LoadedModel, measure: Callable[[], float]) -> None:
        self.probe, self._measure = model.probe, measure

    @functools.cached_property
    def relative(self) -> float:
        return self._measure()

    @staticmethod
    def applies(size: int) -> bool:
        """Whether a batch of ``size`` candidates is screened (smaller ones save too little to pay for the full
        forward of their picks)."""
        return size >= SCREEN_FROM

    def error(self, target: torch.Tensor) -> float:
        """How far a screened row near ``target`` may lie from its row computed in full."""
        return SAFETY * max(self.relative, FLOOR) * norm(target)

    def screened(self, target: torch.Tensor, plain: float) -> Screened:
        """A position's screened-out candidates, for the row ``target`` and the plain radius ``plain``: screened rows
        farther than ``(1 + SLACK) * plain`` plus the screening's error are screened out (the module docstring)."""
        return Screened(lambda: self.error(target), (1 + SLACK) * plain)

    def split(
        self, batch: torch.Tensor, tried: torch.Tensor, prefix: Prefix,
        rows_of: Callable[[torch.Tensor], torch.Tensor], target: torch.Tensor, out: Screened, distances: Distances,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Screen candidates ``batch[tried]`` over ``prefix`` (``rows_of``: their states -> rows): those whose screened
        row lies beyond ``out.radius`` of ``target`` (by ``distances``, 1-Lipschitz in the row as the error model's
        are, so the screening's error adds to them) join ``out``. Returned: which of ``batch`` are to be verified in
        full ``[B]`` (bool), and ``[B, k]`` rows holding the screened-out ones' screened rows (the others' to be
        filled)."""
        screened = rows_of(screened_states(self.probe, prefix, batch[tried]))
        dists = distances(screened, target)
        beyond = dists > out.radius
        far = tried[beyond]
        out.add(batch[far], dists[beyond])
        near, every = torch.ones(len(batch), dtype=torch.bool), torch.empty(len(batch), screened.shape[1])
        near[far], every[far] = False, screened[beyond]
        return near, every


def screened_states(probe: LayerProbe, prefix: Prefix, ids: torch.Tensor) -> torch.Tensor:
    """The screened states ``[n, d]`` of candidates ``ids`` over ``prefix`` (float32)."""
    with torch.no_grad(), probe.screening():
        return probe.continuation(prefix, ids.to(probe.device)).float()


class Screened:
    """One position's screened-out candidates: their ids and screened distances, until verified in full. A candidate
    whose screened row lies farther than ``radius`` is screened out (``error``: the screened distances' own, computed
    on first use by the function given; ``reach``: the radius less it). Once some are taken to be verified in full
    (:meth:`take`), the position screens no more (``open`` False, ``radius`` infinite)."""

    def __init__(self, error: Callable[[], float], reach: float) -> None:
        self._error, self.reach, self.open = error, reach, True
        self.ids: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.count = 0  # screened out and not verified in full since

    @functools.cached_property
    def error(self) -> float:
        return self._error()

    @property
    def radius(self) -> float:
        return self.reach + self.error if self.open else math.inf

    def add(self, ids: torch.Tensor, dists: torch.Tensor) -> None:
        self.ids.append(ids)
        self.dists.append(dists)
        self.count += len(ids)

    def take(self, within: float = math.inf) -> torch.Tensor:
        """The screened-out candidates whose row computed in full could lie within ``within`` of the target (every
        one by default), the nearest first, to be verified in full now: they are no longer screened out, and the
        position screens no more."""
        self.open = False
        if not self.count:
            return torch.empty(0, dtype=torch.long)
        ids, dists = torch.cat(self.ids), torch.cat(self.dists)
        taken = dists - self.error <= within
        self.ids, self.dists, self.count = [ids[~taken]], [dists[~taken]], int((~taken).sum())
        return ids[taken][dists[taken].argsort()]
