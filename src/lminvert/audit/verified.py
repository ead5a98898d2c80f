"""The candidates verified at one position of a rows search (:class:`Verified`), and half the gap from the chosen one
to the nearest other (:func:`half_gap`)."""

from __future__ import annotations

import math

import torch


class Verified:
    """The candidates verified at one position so far: ids, rows, distances to ``target`` (every one measured with the
    rounding inside the radii, also by id in ``measured``)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target.double()
        self.ids: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.measured: dict[int, float] = {}

    def add(self, batch: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add a batch's rows; every candidate verified so far: ``(ids, rows, distances)``."""
        dists = (rows.double() - self.target).norm(dim=1)
        self.measured.update(zip(batch.tolist(), dists.tolist(), strict=True))
        self.ids.append(batch)
        self.rows.append(rows)
        self.dists.append(dists)
        return torch.cat(self.ids), torch.cat(self.rows), torch.cat(self.dists)


def half_gap(ids: torch.Tensor, rows: torch.Tensor, token: int) -> float | None:
    chosen = (ids == token).nonzero().flatten()
    if len(ids) < 2 or not len(chosen):
        return None
    others = torch.cat([rows[: chosen[0]], rows[chosen[0] + 1 :]])
    gap = float((others - rows[chosen[0]]).norm(dim=1).min()) / 2
    return gap if math.isfinite(gap) else None
