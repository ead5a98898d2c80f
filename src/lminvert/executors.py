"""Where independent units of work run: in this process (default) or on a Ray cluster.

An executor maps a picklable function over picklable tasks and returns the results in order. The collision
search uses it for its per-layer searches and the exhaustive test for its per-prefix work; tasks write their
outputs to files, so Ray workers must see the same filesystem (one machine, or a shared disk).

Ray is optional: ``pip install 'lminvert[ray]'``. Nothing imports it unless ``ray`` is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from .errors import LminvertError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    name: str

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]: ...


class InProcessExecutor:
    """Runs tasks one after the other in this process (torch already uses every core inside each task)."""

    name = "inprocess"

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        return [fn(task) for task in tasks]


class RayExecutor:
    """Runs tasks as Ray remote functions, ``num_cpus`` each (joins a running cluster when ``address`` is given)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: float = 1.0) -> None:
        try:
            import ray
        except ImportError:
            raise LminvertError(
                "the ray executor needs Ray: pip install 'lminvert[ray]', or use --executor inprocess"
            ) from None
        self.ray = ray
        self.num_cpus = num_cpus
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        remote = self.ray.remote(num_cpus=self.num_cpus)(fn)
        return list(self.ray.get([remote.remote(task) for task in tasks]))


def get_executor(spec: str | Executor | None = None, **kwargs: Any) -> Executor:
    """``None``/``"inprocess"`` -> :class:`InProcessExecutor`; ``"ray"`` or ``"ray://host:port"`` -> Ray."""
    if spec is None or spec == "inprocess":
        return InProcessExecutor()
    if isinstance(spec, str):
        if spec == "ray":
            return RayExecutor(**kwargs)
        if spec.startswith("ray://"):
            return RayExecutor(address=spec, **kwargs)
        raise LminvertError(f"unknown executor '{spec}': use inprocess or ray (ray://host:port for a cluster)")
    return spec
