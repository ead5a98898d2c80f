"""A model's linear layers in another precision than its own, inside a ``with`` block.

Half-precision models on CPUs without half-precision matrix units: their GEMMs as float32 GEMMs, rounded back.

On a CPU without native bfloat16/float16 GEMM kernels (AVX2: no AVX512-BF16, no AMX) torch emulates them and a
bfloat16 ``linear`` runs ~4-6x slower than a float32 one. Computing it as a float32 GEMM of the same (exactly
representable) operands and rounding the result to the model's dtype is what half-precision hardware does anyway
(float32 accumulation, half output): it gave bit-identical outputs for 99.99% of bfloat16 and 99.8% of float16
elements of a [256, 576] x [576, 1536] product here, the rest one rounding step apart.

:class:`HalfAsFloat32` applies that to a model's linear layers (and GPT-2's Conv1D) inside a ``with`` block;
the probe uses it for its cached forwards (prefix caches, candidate continuations) and never for its plain forward
(:meth:`LayerProbe.states`, what an observer computes), so the acceptance radii, measured between the two
(:mod:`lminvert.invert.tolerance`), include whatever difference remains. :func:`half_is_slow` decides from the CPU's
features (:func:`native_half`).

The other way round, :class:`LinearMath` runs a float32 model's linear layers as bfloat16 GEMMs on a CPU that has
native ones (:func:`native_bfloat16`: ~0.35x float32's time on this project's AVX512-BF16 CPU): the inversion's
*screening* forwards (:mod:`lminvert.invert.engine`), whose states only decide which candidates are verified in
float32, never which one is accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import cpu_flags
from .derived import derived

HALF_UNITS = {  # the CPU flags of the units that run each half type's GEMMs natively (elsewhere torch emulates them)
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}


def native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU has units for ``dtype`` GEMMs (:data:`HALF_UNITS`): a fixed fact of the machine, recorded with
    every cache entry (its CPU features), not a timing (one under load could change the numeric path between two
    processes). On this project's CPU (AVX512-BF16, AVX512-FP16, AMX-BF16) a bfloat16 GEMM of [128, 512] x [512,
    1024] took 0.35x and a float16 one 1.1x the float32 one; an AVX2 CPU emulates them at ~4x."""
    return bool(HALF_UNITS.get(dtype, frozenset()) & cpu_flags())


def half_is_slow(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` GEMM on this CPU is emulated (no :func:`native_half` units): much slower than the float32
    GEMM it can be replaced by."""
    return not native_half(dtype)


def native_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 GEMMs on ``device`` are fast: a GPU, or a CPU with bfloat16 units (:func:`native_half`)."""
    return device.type == "cuda" or (device.type == "cpu" and native_half(torch.bfloat16))


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or transformers' ``Conv1D`` itself, not a subclass (a quantised layer keeps its own forward)."""
    return type(module) is nn.Linear or type(module).__name__ == "Conv1D"


def all_linear_plain(model: nn.Module) -> bool:
    """Whether every linear layer of ``model`` is a plain one (:class:`LinearMath` covers them all): false for a
    quantised model (bitsandbytes' layers subclass ``nn.Linear`` and hold packed weights)."""
    return all(_plain_linear(m) for m in model.modules() if isinstance(m, nn.Linear))


class LinearMath:
    """Inside ``with``: the ``dtype`` linear layers of ``model`` (``nn.Linear`` and transformers' ``Conv1D``) run as
    ``math`` GEMMs of operands converted to ``math``, rounded back to ``dtype``, their weights converted once (again
    after an in-place edit).

    Each such module's ``forward`` is replaced for the duration (an instance attribute, which ``nn.Module`` calls
    instead of the class's), so only the linear layers pay anything: a ``TorchFunctionMode`` intercepting every
    torch call of the forward instead cost SmolLM2 ~11 ms per cached verification forward at layer 15 (46 against
    35 ms for the float32 model). Nested ``with`` blocks are fine; a linear layer called on another dtype runs as
    the model does."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, math: torch.dtype) -> None:
        self.dtype, self.math = dtype, math
        self._modules = [m for m in model.modules() if _plain_linear(m)]
        self._copies: dict[int, tuple] = {}  # id -> (tensor, its version, the copy in math): models.derived
        self._depth = 0
        self._kept: list[object] = []  # what each module's instance ``forward`` was before (None: the class's)

    def _converted(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return derived(self._copies, id(tensor), tensor, lambda: tensor.detach().to(self.math))

    def _forward(self, module: nn.Module):
        native = module.__dict__.get("forward") or type(module).forward.__get__(module)
        if isinstance(module, nn.Linear):

            def linear(x: torch.Tensor) -> torch.Tensor:
                if x.dtype != self.dtype or module.weight.dtype != self.dtype:
                    return native(x)
                weight, bias = self._converted(module.weight), self._converted(module.bias)
                return F.linear(x.to(self.math), weight, bias).to(self.dtype)

            return linear

        def conv1d(x: torch.Tensor) -> torch.Tensor:  # transformers' Conv1D: x @ weight + bias, weight [in, out]
            if x.dtype != self.dtype or module.weight.dtype != self.dtype:
                return native(x)
            flat = torch.addmm(
                self._converted(module.bias), x.reshape(-1, x.shape[-1]).to(self.math), self._converted(module.weight)
            )
            return flat.to(self.dtype).view(*x.shape[:-1], flat.shape[-1])

        return conv1d

    def __enter__(self) -> LinearMath:
        if self._depth == 0:
            self._kept = [module.__dict__.get("forward") for module in self._modules]  # e.g. another library's wrapper
            for module in self._modules:
                module.forward = self._forward(module)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for module, forward in zip(self._modules, self._kept, strict=True):
                if forward is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = forward


class HalfAsFloat32(LinearMath):
    """A half model's linear layers as float32 GEMMs rounded back (see :class:`LinearMath`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(model, dtype, torch.float32)
