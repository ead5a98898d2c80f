"""Rigorous floating-point error bounds for GEMM-based squared distances.

The blocked search computes, for float32 vectors ``a`` (a row) and ``b`` (a column) of length ``d``,

    r = fl( ñ_a + Σ_k a_k (-2 b_k) + ñ_b )          (one ``addmm`` with an augmented column)

where ``ñ = fl32(‖v‖²)`` is the squared norm computed in float64 and rounded once to float32. Whatever order
the BLAS sums these ``d + 2`` terms in (blocked, FMA or not), the classical bound for a dot product of length
``m`` (Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 3.5) gives

    |r - (ñ_a + ñ_b - 2 a·b)| <= γ_{d+2} (2 Σ|a_k b_k| + ñ_a + ñ_b),     γ_m = m u / (1 - m u),  u = 2^-24,

(scaling by -2 is exact; a separate final addition of the bias folds into γ_{d+2} too, since
(1 + θ_{d+1})(1 + δ) = 1 + θ_{d+2}). The operands are padded with zero columns to a multiple of 4 (MKL is faster);
zero terms add no rounding, but the search counts them anyway (it calls these functions with ``d`` = the padded
width - 1). With ``|ñ - n| <= u' n`` and ``Σ|a_k b_k| <= ‖a‖‖b‖`` this bounds the error
of ``r`` against ``‖a - b‖²`` of the float32 vectors by :func:`sq_error_bound`.

The float32 vectors are themselves roundings of the float64-centred states ``x - μ``: ``a = (x - μ)(1 + δ)``
componentwise with ``|δ| <= u'`` (one float64 subtraction, one cast), so ``|‖a_i - a_j‖ - ‖x_i - x_j‖| <=
η_ij = u'' (‖a_i‖ + ‖a_j‖)`` (:func:`cast_error_bound`). A pair whose exact distance satisfies
``‖x_i - x_j‖² <= T`` therefore always has ``r_ij <= (√T + η_ij)² + E_ij`` (:func:`candidate_cutoff`): a tile
whose computed values all exceed that cutoff cannot hold such a pair.

Every constant is inflated by a relative safety factor of 1e-6 and an absolute floor of 1e-30 (for float32
underflow in products of tiny components), so the bound is never tighter than the arithmetic allows.
"""

from __future__ import annotations

import numpy as np
import torch

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
U64 = 2.0**-53  # unit roundoff of float64
SAFETY = 1.0 + 1e-6
TINY = 1e-30


def gamma(m: int, u: float = U32) -> float:
    """Higham's γ_m = m u / (1 - m u); valid while m u < 1."""
    if m * u >= 1.0:
        raise ValueError(f"gamma_{m} is undefined for u={u}: the dot product is too long for this precision")
    return m * u / (1.0 - m * u)


def norm_rounding(d: int) -> float:
    """Relative error of ``fl32(‖v‖²)`` when ``‖v‖²`` is summed in float64 and cast once."""
    return U32 + gamma(d, U64) * (1.0 + U32)


def cast_rounding() -> float:
    """Relative per-component error of ``fl32(fl64(x - μ))`` against the exact ``x - μ``."""
    return (U32 + U64 + U32 * U64) / (1.0 - U32 - U64)


def sq_error_bound(
    norm_a: torch.Tensor | np.ndarray | float,
    norm_b: torch.Tensor | np.ndarray | float,
    d: int,
) -> torch.Tensor | np.ndarray | float:
    """Bound on ``|r - ‖a - b‖²|`` for the augmented-GEMM value ``r`` (norms are ‖·‖, not squared; broadcasts)."""
    g = gamma(d + 2)
    un = norm_rounding(d)
    sq_a = norm_a * norm_a
    sq_b = norm_b * norm_b
    bound = g * (2.0 * norm_a * norm_b + (1.0 + un) * (sq_a + sq_b)) + un * (sq_a + sq_b)
    return bound * SAFETY + TINY


def cast_error_bound(
    norm_a: torch.Tensor | np.ndarray | float, norm_b: torch.Tensor | np.ndarray | float
) -> torch.Tensor | np.ndarray | float:
    """Bound η on ``|‖a_i - a_j‖ - ‖x_i - x_j‖|`` caused by rounding the centred vectors to float32."""
    return (norm_a + norm_b) * cast_rounding() * SAFETY + TINY


def candidate_cutoff(
    cutoff_sq: float,
    norm_a: torch.Tensor | np.ndarray | float,
    norm_b: torch.Tensor | np.ndarray | float,
    d: int,
) -> torch.Tensor | np.ndarray | float:
    """Largest computed value ``r`` a pair with exact squared distance <= ``cutoff_sq`` can have."""
    eta = cast_error_bound(norm_a, norm_b)
    root = float(np.sqrt(cutoff_sq)) if np.isfinite(cutoff_sq) else float("inf")
    return (root + eta) ** 2 + sq_error_bound(norm_a, norm_b, d)
