"""The pieces the exact pair search (:mod:`.search`) is made of: the input check, the two GEMM operands with their
augmented norm column, the tile shape, and the float64 re-measurement of pairs from the vectors themselves."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LminvertError

ArrayLike = np.ndarray | torch.Tensor

EXACT_CHUNK = 8192  # pairs re-measured per float64 batch


def exact_sq_distances(x: ArrayLike, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``Σ_k (x_ik - x_jk)²`` in float64, from the vectors themselves (float32 inputs are widened exactly)."""
    out = np.empty(len(i), dtype=np.float64)
    for start in range(0, len(i), EXACT_CHUNK):
        stop = start + EXACT_CHUNK
        a = _rows64(x, i[start:stop])
        b = _rows64(x, j[start:stop])
        diff = a - b
        out[start:stop] = np.einsum("ij,ij->i", diff, diff)
    return out


def _rows64(x: ArrayLike, index: np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x[torch.from_numpy(np.asarray(index, dtype=np.int64))].double().numpy()
    return np.asarray(x[np.asarray(index, dtype=np.int64)], dtype=np.float64)


def tile_shape(n: int, tile_rows: int, tile_cols: int) -> tuple[int, int]:
    """The tile the search uses for N vectors: rows capped near N/8 for small N, columns >= rows."""
    # the diagonal tiles waste half their work: for small N, shorter row blocks keep that waste near 1/8
    rows = max(1, min(int(tile_rows), max(256, -(-n // 8 // 64) * 64)))
    return rows, max(rows, int(tile_cols))  # the diagonal square must fit in the first column chunk


def check_input(x: ArrayLike) -> tuple[int, int]:
    """``(N, d)`` of a ``[N, d]`` float32 or float64 array of at least two vectors; a one-line error otherwise."""
    if not hasattr(x, "ndim") or not hasattr(x, "shape"):
        raise LminvertError(f"expected a [N, d] tensor or numpy array of vectors, got {type(x).__name__}")
    if x.ndim != 2:
        raise LminvertError(f"expected a [N, d] array of vectors, got shape {list(x.shape)}")
    n, d = int(x.shape[0]), int(x.shape[1])
    if n < 2:
        raise LminvertError(f"need at least 2 vectors to compare, got {n}")
    if d < 1:
        raise LminvertError("vectors have dimension 0")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype not in ("float32", "float64"):
        raise LminvertError(f"vectors must be float32 or float64, got {dtype}")
    return n, d


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` ranges of ``size`` covering ``0..n``."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


@dataclass
class Operands:
    P: torch.Tensor  # [N, w] float32: [a, fl32(|a|²), 0...] (w = padded_width(d))
    Q: torch.Tensor  # [N, w] float32: [-2a, 1, 0...]
    bias: torch.Tensor  # [N] float32: fl32(|a|²)
    norm: torch.Tensor  # [N] float64: |a| (of the float32 vectors)
    offset_norm: float


def padded_width(d: int) -> int:
    """Columns of the GEMM operands: d, the norm column, zeros up to a multiple of 4 (MKL runs 577 ~7 % slower)."""
    return -(-(d + 1) // 4) * 4


def as_tensor(x: ArrayLike) -> torch.Tensor:
    """A zero-copy torch view of ``x`` where possible (numpy arrays and memmaps included)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.from_numpy(np.asarray(x))


def prepare(x: ArrayLike, chunk: int = 8192) -> Operands:
    """Centre on the mean (held in the input dtype: any translation will do), round once to float32."""
    xt = as_tensor(x)
    n, d = xt.shape
    mean = xt.mean(dim=0)  # in the input dtype, so ``x - mean`` below rounds once
    width = padded_width(d)
    P = torch.zeros(n, width, dtype=torch.float32)  # the padding columns stay 0: exact, they add no rounding
    Q = torch.zeros(n, width, dtype=torch.float32)
    sq = np.empty(n, dtype=np.float64)
    P_np = P.numpy()
    for start, stop in chunks(n, chunk):
        if xt.dtype == torch.float32:
            torch.sub(xt[start:stop], mean, out=P[start:stop, :d])
        else:
            P[start:stop, :d] = (xt[start:stop] - mean).float()
        a = P_np[start:stop, :d]
        sq[start:stop] = np.einsum("ij,ij->i", a, a, dtype=np.float64)
        torch.mul(P[start:stop, :d], -2.0, out=Q[start:stop, :d])
    if not np.isfinite(sq).all():  # NaN/inf anywhere in x reaches the mean or the row's norm
        raise LminvertError("vectors contain NaN or inf (or are too large for float32 after centring): check the input")
    if float(sq.max()) >= 1e36:
        raise LminvertError("vectors are too large for float32 squared distances (norm > 1e18): rescale them first")
    sq_t = torch.from_numpy(sq)
    P[:, d] = sq_t.float()
    Q[:, d] = 1.0
    return Operands(P, Q, P[:, d].clone(), sq_t.sqrt(), float(mean.double().norm()))


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Make sure float32 GEMMs really run in float32 (no TF32 / bf16 shortcuts that void the bound)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
