"""The acceptance test: an L2 ball around the observed state, sized from dtype and the state's norm.

A candidate is verified by a cached, batched one-position forward, while the observed state came from a
plain full forward: different kernels, different rounding. Measured on SmolLM2 (float32), the two differ by
~1e-6 of the state's norm at layers 1..30 (tests/integration/test_smollm2.py bounds it at 1e-5). The
default tolerance is ``KAPPA[dtype] * eps(dtype) * ||h||``: 1.5e-5 * ||h|| for float32, an order of
magnitude above that rounding and far below the distance between distinct tokens' states (>1e-3 * ||h||
in the collision search at the same layers).
"""

from __future__ import annotations

import math

import torch

KAPPA = {torch.float32: 128.0, torch.bfloat16: 4.0, torch.float16: 16.0, torch.float64: 1e6}


def tolerance(target: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Radius of the acceptance ball for an observed state ``target`` from a model running in ``dtype``."""
    eps = torch.finfo(dtype).eps
    return float(scale * KAPPA.get(dtype, 128.0) * eps * target.double().norm())


def noise_tolerance(target: torch.Tensor, sigma: float) -> float:
    """Upper bound (4 standard deviations) on the norm of relative Gaussian noise of level ``sigma``.

    The noise is ``sigma * ||h|| * g / sqrt(d)`` with ``g ~ N(0, I_d)``; ``||g||`` concentrates at sqrt(d)
    with standard deviation ~1/sqrt(2).
    """
    if sigma <= 0:
        return 0.0
    d = target.numel()
    return float(sigma * target.double().norm() * (1.0 + 4.0 / math.sqrt(2.0 * d)))


def add_noise(states: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``states + sigma * ||h_t|| * g_t / sqrt(d)`` per position (relative Gaussian noise)."""
    if sigma <= 0:
        return states
    g = torch.randn(states.shape, generator=generator, dtype=torch.float64)
    scale = sigma * states.double().norm(dim=-1, keepdim=True) / math.sqrt(states.shape[-1])
    return (states.double() + scale * g).to(states.dtype)
