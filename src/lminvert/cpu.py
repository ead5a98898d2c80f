"""What this machine's CPU is and which vector units it has: the features that decide which kernels torch runs (and so
the last bits of what they compute, and whether half-precision GEMMs are fast). Read from ``/proc/cpuinfo``."""

from __future__ import annotations

import functools
import platform

import torch


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (read once per process; empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break  # the end of the first processor's block
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")  # change kernels


def cpu_features() -> str:
    """The CPU's vector features that decide which kernels torch runs (and so the last bits of what they compute):
    torch's dispatch level and the half-precision units ``/proc/cpuinfo`` reports, e.g. ``AVX512 avx2 amx_bf16``."""
    flags = cpu_flags()
    return " ".join([torch.backends.cpu.get_cpu_capability(), *(f for f in CPU_FLAGS if f in flags)])


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags ``/proc/cpuinfo`` reports for the first processor (none where there is no such file)."""
    return frozenset(_cpuinfo().get("flags", "").split())
