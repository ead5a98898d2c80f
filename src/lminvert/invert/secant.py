"""The secant linear model of a position's map from input vectors to states: ``h(x) ~ a + x J``.

Fitted by ridge regression on centred (input vector, state) pairs; optionally pulled towards a previous ``J``.
Used twice: offline, for the position-1 prior map cached with the first-position table
(:func:`lminvert.invert.tables.second_position_map`), and online by :class:`~lminvert.invert.linear.LinearPolicy`,
whose ranking also needs the quadratic term ``||x_v J||^2`` of every vocabulary row (:func:`projected_norms`).
"""

from __future__ import annotations

import torch

RANDOMISED = True  # projected_norms' eigenpairs by a randomised range finder (top_pairs); False: a full eigh
OVERSAMPLE = 8  # columns drawn beyond the rank


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
    solve: torch.dtype | None = None,
) -> torch.Tensor:
    """``J`` [d_in, d] minimising ``||x J - h||^2 + ridge*E*||J||^2 + prior_weight*E*||J - prior||^2``.

    ``x`` and ``h`` are centred pairs; ``E = ||x||^2`` makes both penalties relative to the data's energy, so the same
    settings work at every layer and scale (``E = 0``: the prior where one is given, else zeros). The products
    ``x^T x`` and ``x^T h`` run in ``x``'s dtype, the solve (and ``J``) in ``solve``'s (default ``x``'s; float64 for a
    well-conditioned solve: float32 products then take about two thirds of float64's time for many rows,
    :data:`lminvert.invert.reading.PRODUCTS`).
    """
    solve = x.dtype if solve is None else solve
    energy = float(x.to(solve).square().sum())
    if not energy > 0:  # no spread among the inputs (one pair, or equal ones): they say nothing of J
        base = prior if prior is not None and prior_weight > 0 else torch.zeros(x.shape[1], h.shape[1])
        return base.to(dtype=solve, device=x.device)
    eye = torch.eye(x.shape[1], dtype=solve, device=x.device)
    gram, rhs = (x.T @ x).to(solve) + ridge * energy * eye, (x.T @ h).to(solve)
    if prior is not None and prior_weight > 0:
        gram = gram + prior_weight * energy * eye
        rhs = rhs + prior_weight * energy * prior.to(dtype=solve, device=x.device)
    return torch.linalg.solve(gram, rhs)


def projected_norms(
    rows: torch.Tensor, row_norms: torch.Tensor, jac: torch.Tensor, rank: int, low: torch.Tensor | None = None
) -> torch.Tensor:
    """``||x_v J||^2`` ``[V]`` (float32) for every row ``x_v`` of ``rows`` ``[V, d_in]`` (``row_norms``: their
    ``||x_v||^2``), from the ``rank`` largest eigenpairs ``(l_i, u_i)`` of ``J J^T`` (:func:`top_pairs`): ``sum_i l_i
    (x_v . u_i)^2`` plus the other eigenvalues' mean times what of ``||x_v||^2`` they span. A product with ``rank``
    columns instead of ``d``: on SmolLM2 (d = 576, rank 64) ~50 ms instead of ~220 ms on this project's 2-core CPU, and
    the true token's place in the linear policy's ranking as good as with the exact norms (a random-id prompt at layers
    9 and 12: in the top 16 after 52% / 43% of its later batches, exact 52% / 43%). Exact where ``d_in <= 2 rank``.
    ``low``: ``rows`` in bfloat16 (:meth:`lminvert.models.LayerProbe.low_vocab`), for that product where bfloat16 GEMMs
    are native (the norms only order candidates)."""
    jac = jac.to(device=rows.device, dtype=torch.float32)
    if rows.shape[1] <= 2 * rank:
        return (rows @ jac).square().sum(1)
    top, values = top_pairs(jac, rank) if RANDOMISED else _eigen_pairs(jac, rank)
    rest = max((float(jac.square().sum()) - float(values.sum())) / (jac.shape[0] - rank), 0.0)  # the others' mean
    # sum_i l_i a_i^2 + rest (||x||^2 - sum_i a_i^2) = ||x U diag(sqrt(l_i - rest))||^2 + rest ||x||^2: one product and
    # one pass over its [V, rank] output (Gemma-3-270m's vocabulary, bfloat16: 113 against 166 ms)
    scaled = top * (values - rest).clamp_min(0.0).sqrt()
    along = rows @ scaled if low is None else low @ scaled.to(low.dtype)  # [V, rank]
    return torch.linalg.vector_norm(along, dim=1, dtype=torch.float32).square_().add_(row_norms, alpha=rest)


def _eigen_pairs(jac: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` largest eigenpairs of ``J J^T`` by a full eigendecomposition: vectors ``[d_in, rank]``, values."""
    values, vectors = torch.linalg.eigh(jac @ jac.T)  # ascending
    return vectors[:, -rank:], values[-rank:].clamp_min(0.0)


def top_pairs(jac: torch.Tensor, rank: int, power: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """About the ``rank`` largest eigenpairs of ``J J^T`` (``J``'s left singular vectors ``[d_in, rank]`` and squared
    singular values) by a randomised range finder with ``power`` subspace iterations (Halko, Martinsson and Tropp,
    2011), from a fixed draw so that the same ``J`` gives the same pairs. On SmolLM2's layer-30 position-1 map at rank
    64 (:func:`projected_norms` on every token): a median relative error against the exact norms of 5.27% against the
    full decomposition's 5.15%, the 1,000 smallest sharing 884 of the exact norms' against 886, in 19.5 ms against
    28.2 ms on this project's CPU."""
    draw = torch.randn(jac.shape[1], rank + OVERSAMPLE, generator=torch.Generator().manual_seed(0))
    basis = torch.linalg.qr(jac @ draw.to(jac.device)).Q
    for _ in range(power):
        basis = torch.linalg.qr(jac @ (jac.T @ basis)).Q
    left, singular, _ = torch.linalg.svd(basis.T @ jac, full_matrices=False)
    return basis @ left[:, :rank], singular[:rank].square()
