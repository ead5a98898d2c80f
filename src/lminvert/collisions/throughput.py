"""What a run needs to be reproducible and judged: this machine's matmul FLOP/s, peak memory, versions.

``matmul_fraction`` compares the search's *useful* arithmetic rate, 2·d flops per pair (the dot product that
any GEMM-based method must do for it; the squared norms, the augmented column, the diagonal tiles' wasted
half and the reductions are not counted), with ``torch.mm`` on float32 operands of the very tile shape the
search uses (``[R, d] @ [d, C]``, contiguous), measured in the same process.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch

from .search import ieee_float32_matmul


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


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024.0 if sys.platform != "darwin" else peak / 2**20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def versions() -> dict[str, str]:
    import numpy
    import transformers

    from .. import __version__

    return {
        "lminvert": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
    }
