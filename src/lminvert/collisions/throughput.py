"""The reference that ``matmul_fraction`` is measured against: this machine's float32 matmul FLOP/s.

``matmul_fraction`` compares the search's *useful* arithmetic rate, 2·d flops per pair (the dot product that
any GEMM-based method must do for it; the squared norms, the augmented column, the diagonal tiles' wasted
half and the reductions are not counted), with ``torch.mm`` on float32 operands of the very tile shape the
search uses (``[R, d] @ [d, C]``, contiguous), measured in the same process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .operands import ieee_float32_matmul, tile_shape


def matmul_flops(rows: int, cols: int, d: int, reps: int = 5) -> list[float]:
    """FLOP/s of ``torch.mm`` for ``[rows, d] @ [d, cols]`` in float32, one figure per repetition (after warm-up)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, d, generator=gen)
    b = torch.randn(cols, d, generator=gen)
    out = torch.empty(rows, cols)
    rates = []
    with ieee_float32_matmul(), torch.no_grad():
        torch.mm(a, b.T, out=out)
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b.T, out=out)
            rates.append(2.0 * rows * cols * d / (time.perf_counter() - start))
    return rates


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def matmul_reference(
    n: int, d: int, tile_rows: int, tile_cols: int, reps: int = 5, earlier: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Measure ``torch.mm`` at the search's full-tile shape for ``n`` vectors of dimension ``d``.

    A run measures it before and after its searches (``earlier``: the first measurement); the reference is the
    median of all samples, so one slow moment of the machine does not skew the fraction.
    """
    rows, cols = tile_shape(n, tile_rows, tile_cols)
    rows, cols = min(rows, n), min(cols, n)
    samples = [*(earlier or {}).get("samples", []), *matmul_flops(rows, cols, d, reps=reps)]
    return {"flops_per_second": median(samples), "samples": samples, "shape": [rows, d, cols]}
