"""Half-precision models on CPUs without half-precision matrix units: their GEMMs as float32 GEMMs, rounded back.

On a CPU without native bfloat16/float16 GEMM kernels (AVX2: no AVX512-BF16, no AMX) torch emulates them and a
bfloat16 ``linear`` runs ~4-6x slower than a float32 one. Computing it as a float32 GEMM of the same (exactly
representable) operands and rounding the result to the model's dtype is what half-precision hardware does anyway
(float32 accumulation, half output): it gave bit-identical outputs for 99.99% of bfloat16 and 99.8% of float16
elements of a [256, 576] x [576, 1536] product here, the rest one rounding step apart.

:class:`HalfAsFloat32` applies that to ``F.linear`` and ``torch.addmm`` (GPT-2's Conv1D) inside a ``with`` block;
the probe uses it for its cached forwards (prefix caches, candidate continuations) and never for its plain forward
(:meth:`LayerProbe.states`, what an observer computes), so the acceptance radii, measured between the two
(:mod:`lminvert.invert.tolerance`), include whatever difference remains. :func:`half_is_slow` decides, once per
process and dtype, by timing both ways.

The other way round, for a float32 model: a ranking's product of the vocabulary with one vector is bound by the bytes
it reads, and a float16 matrix-vector product (no GEMM kernel needed) reads half of them. :func:`faster_in_half`
decides, once per probe, whether :meth:`lminvert.models.LayerProbe.vocab_dots` runs it on a float16 copy.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SLOW: dict[torch.dtype, bool] = {}


def half_is_slow(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` GEMM on this CPU is more than 1.5x slower than the float32 GEMM it can be replaced by."""
    if dtype not in _SLOW:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(128, 512, generator=gen)
        w = torch.randn(1024, 512, generator=gen)

        def best(a: torch.Tensor, b: torch.Tensor) -> float:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                F.linear(a, b)
                times.append(time.perf_counter() - start)
            return min(times)

        _SLOW[dtype] = best(x.to(dtype), w.to(dtype)) > 1.5 * best(x, w)
    return _SLOW[dtype]


def faster_in_half(matrix: torch.Tensor) -> bool:
    """Whether a float16 matrix-vector product with (a copy of) ``matrix`` runs more than 1.5x faster than the float32
    one on this CPU (on this project's AVX2 CPU: SmolLM2's vocabulary, 2 threads, 2.9 vs 9.7 ms, half the bytes read;
    a [20, d] product is slower in float16, 48 vs 30 ms). Timed on the matrix itself, best of 3 each."""
    vector = torch.ones(matrix.shape[1], dtype=matrix.dtype)
    half, half_vector = matrix.half(), vector.half()

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        a @ b  # warm
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best(half, half_vector) * 1.5 < best(matrix, vector)


class HalfAsFloat32(TorchFunctionMode):
    """Inside ``with``: ``dtype`` linear layers run as float32 GEMMs rounded to ``dtype`` (weights converted once)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._copies: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # id -> (version, tensor, float32)

    def _float(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if not isinstance(tensor, torch.nn.Parameter):
            return tensor.float()
        key = id(tensor)
        entry = self._copies.get(key)
        if entry is None or entry[1] is not tensor or entry[0] != tensor._version:  # edited in place: convert again
            entry = (tensor._version, tensor, tensor.detach().float())
            self._copies[key] = entry
        return entry[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype == self.dtype and weight.dtype == self.dtype:
                return F.linear(x.float(), self._float(weight), self._float(bias)).to(self.dtype)
        elif func is torch.addmm and not kwargs:
            bias, m1, m2 = args[:3]
            if len(args) == 3 and m1.dtype == self.dtype and m2.dtype == self.dtype:
                return torch.addmm(self._float(bias), m1.float(), self._float(m2)).to(self.dtype)
        return func(*args, **kwargs)
