"""Run directories: the one place that creates, checks, resumes and finishes an output directory.

Every command that writes a directory (collision search, exhaustive test, and the experiments built on them)
goes through :class:`RunDirectory`:

* ``manifest.json`` - the run's kind, config and versions. A directory is resumed only by a run of the same kind
  whose identifying config fields agree; anything else is refused with a one-line error;
* :meth:`RunDirectory.step` - a small resumable step whose JSON result is kept in the directory
  (e.g. the rounding-noise estimate), computed once;
* :meth:`RunDirectory.write_results` - ``results.json``, written atomically.

:func:`run_metadata` is what every results file records besides its numbers: machine, versions, threads, dtype,
seed, the model's description and the peak memory. Rendering (results.md, figures) belongs to
:mod:`lminvert.report`.
"""

from __future__ import annotations

import logging
import os
import platform
import resource
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from .cpu import cpu_features, cpu_model
from .errors import LminvertError
from .paths import check_output_dir, read_json, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RESULTS = "results.json"

T = TypeVar("T")


def versions() -> dict[str, str]:
    import numpy
    import transformers

    from ._version import __version__

    return {
        "lminvert": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024.0 if sys.platform != "darwin" else peak / 2**20


def run_metadata(model_info: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """What every results file records besides its numbers."""
    here = machine()
    return {
        "memory_peak_mb": peak_rss_mb(),
        "seed": seed,
        "dtype": model_info.get("dtype"),
        "threads": here["torch_threads"],
        "machine": here,
        "versions": versions(),
        "model_info": dict(model_info),
    }


class RunDirectory:
    """An output directory for one run of ``kind``, created or resumed.

    ``identity`` names the config fields that must match for a directory to be resumed (the others only change
    how fast the run goes, e.g. tile sizes or the executor).
    """

    def __init__(self, path: str | Path | None, kind: str, config: Mapping[str, Any], identity: Sequence[str]):
        self.kind = kind
        # a path that cannot be written is a one-line error here, before the run's work (callers of the API too)
        self.path = check_output_dir(path) if path is not None else Path(tempfile.mkdtemp(prefix=f"lminvert-{kind}-"))
        self.config = dict(config)
        manifest = self.path / MANIFEST
        # a manifest with nothing computed beside it (a run stopped by bad input before any work) is not resumed
        self.resumed = manifest.exists() and any(p.is_file() and p.name != MANIFEST for p in self.path.rglob("*"))
        if not self.resumed:
            write_json(manifest, {"kind": kind, "config": self.config, "versions": versions()})
            return
        old = read_json(manifest)
        old_kind = old.get("kind", kind)
        if old_kind != kind:
            raise LminvertError(
                f"{self.path} holds a run of kind '{old_kind}', not '{kind}'; use a new --out directory"
            )
        before = old.get("config", {})
        for key in identity:
            if before.get(key) != self.config.get(key):
                raise LminvertError(
                    f"{self.path} holds a different {kind} run ({key}: {before.get(key)!r} there, "
                    f"{self.config.get(key)!r} now); use a new --out directory or delete that one"
                )
        log.info("resuming the %s run in %s", kind, self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def step(self, name: str, compute: Callable[[], T]) -> T:
        """The JSON result of a resumable step: read from ``name`` if a previous run finished it, else computed
        and written there."""
        path = self.path / name
        if path.exists():
            return read_json(path)
        value = compute()
        write_json(path, value)
        return value

    def write_results(self, doc: Mapping[str, Any]) -> Path:
        """``results.json`` (atomically)."""
        return write_json(self.path / RESULTS, dict(doc))
