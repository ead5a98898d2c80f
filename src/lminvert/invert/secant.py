"""The secant linear model of a position's map from input vectors to states: ``h(x) ~ a + x J``.

Fitted by ridge regression on centred (input vector, state) pairs; optionally pulled towards a previous
``J``. Used twice: offline, for the position-1 prior map cached with the first-position table
(:func:`lminvert.invert.tables.second_position_map`), and online by :class:`~lminvert.invert.policies.LinearPolicy`.
"""

from __future__ import annotations

import torch


def centre(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract the column means (the offset ``a`` is estimated apart)."""
    if len(x) == 0:
        return x, h
    return x - x.mean(0), h - h.mean(0)


def fit_secant_map(
    x: torch.Tensor,
    h: torch.Tensor,
    ridge: float = 1e-3,
    prior: torch.Tensor | None = None,
    prior_weight: float = 0.0,
) -> torch.Tensor:
    """``J`` [d_in, d] minimising ``||x J - h||^2 + ridge*E*||J||^2 + prior_weight*E*||J - prior||^2``.

    ``x`` and ``h`` are centred pairs (float64 for a well-conditioned solve); ``E = ||x||^2`` makes both
    penalties relative to the data's energy, so the same settings work at every layer and scale.
    """
    energy = float(x.square().sum())
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    gram, rhs = x.T @ x + ridge * energy * eye, x.T @ h
    if prior is not None and prior_weight > 0:
        gram = gram + prior_weight * energy * eye
        rhs = rhs + prior_weight * energy * prior.to(dtype=x.dtype, device=x.device)
    return torch.linalg.solve(gram, rhs)
