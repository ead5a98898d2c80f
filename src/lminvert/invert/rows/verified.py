"""The candidates verified at one position of a rows search (:class:`Verified`), and what the chosen one's evidence
was (:func:`measure`: its distance, the nearest other's, half the gap between their rows)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import acceptor
from ..results import KNOWN

Distances = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [n, k], target [k]) -> [n] float64


class Verified:
    """The candidates verified at one position so far: ids, rows, distances to ``target`` (by ``distances``: the error
    model's, :meth:`lminvert.invert.sources.ErrorModel.distances`; every one measured with the rounding inside the
    radii, also by id in ``measured``)."""

    def __init__(self, target: torch.Tensor, distances: Distances) -> None:
        self.target, self.distances = target.double(), distances
        self.ids: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.measured: dict[int, float] = {}

    def add(self, batch: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add a batch's rows; every candidate verified so far: ``(ids, rows, distances)``."""
        dists = self.distances(rows, self.target)
        self.measured.update(zip(batch.tolist(), dists.tolist(), strict=True))
        self.ids.append(batch)
        self.rows.append(rows)
        self.dists.append(dists)
        return torch.cat(self.ids), torch.cat(self.rows), torch.cat(self.dists)


@dataclass(frozen=True)
class Measure:
    """The chosen token's evidence at a position: its row's distance to the target (inf where it was not verified),
    the nearest other verified row's distance (inf: none), half the gap from its row to the nearest other row (None:
    no other row, or it was not verified)."""

    distance: float = math.inf
    margin: float = math.inf
    half_gap: float | None = None


def measure(ids: torch.Tensor, rows: torch.Tensor, dists: torch.Tensor, token: int) -> Measure:
    """:class:`Measure` of ``token`` among the verified ``ids`` (rows ``rows``, distances ``dists``)."""
    chosen = (ids == token).nonzero().flatten()
    if not len(chosen):
        return Measure()
    i = int(chosen[0])
    distance = float(dists[i])
    if len(ids) < 2:
        return Measure(distance)
    others = torch.cat([rows[:i], rows[i + 1 :]])
    margin = float(torch.cat([dists[:i], dists[i + 1 :]]).min())
    gap = float((others - rows[i]).norm(dim=1).min()) / 2
    return Measure(distance, margin, gap if math.isfinite(gap) else None)


@dataclass(frozen=True)
class Found:
    """One prompt's rows search, position by position (:meth:`add`; the lists grow in place)."""

    token_ids: list[int] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    checked: list[int] = field(default_factory=list)  # candidates checked per position (in full or screened out)
    measures: list[Measure] = field(default_factory=list)  # the chosen row's distance, the nearest other's, the gap
    tolerances: list[float] = field(default_factory=list)  # the acceptance radius (error bound plus rounding)
    reasons: list[str] = field(default_factory=list)  # the acceptor's reason for each verdict
    seconds: float = 0.0
    cut: int = 0  # positions the time bound limited to their first batch of candidates

    @classmethod
    def given(cls, known: Sequence[int]) -> Found:
        """A search whose first tokens ``known`` are another search's sure ones: their entries here are placeholders
        (``uncertain``, no evidence, reason :data:`KNOWN`) that the caller replaces with its own."""
        found = cls()
        for token in known:
            found.add(token, acceptor.UNCERTAIN, 0, Measure(), math.nan, KNOWN)
        return found

    def add(self, token: int, verdict: str, checked: int, chosen: Measure, tolerance: float, reason: str) -> None:
        """The next position's token, verdict and evidence."""
        self.token_ids.append(token)
        self.verdicts.append(verdict)
        self.checked.append(checked)
        self.measures.append(chosen)
        self.tolerances.append(tolerance)
        self.reasons.append(reason)

    @property
    def half_gaps(self) -> list[float | None]:
        """Half the distance from each chosen row to the nearest other verified row (None: not measured)."""
        return [m.half_gap for m in self.measures]
