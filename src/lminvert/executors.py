"""Where independent units of work run: in this process (default) or on a Ray cluster (:mod:`.ray_executor`).

An executor runs a picklable function over picklable tasks. Two shapes of work, one interface:

* :meth:`Executor.map` - ``fn(task)`` for each task, results in order (the per-layer searches);
* :meth:`Executor.map_with` - ``fn(state, task)``, where ``state`` is made once per worker by a
  :class:`WorkerSetup` (a loaded model: :class:`ModelSetup`), results streamed back as ``(index, result)``
  in the order they finish, so the caller keeps each one (a store chunk, a unit file) as it arrives.

In this process a setup returns what the caller already holds (the loaded model itself); on a Ray worker it is
made once, there. The algorithms only see this interface. Tasks that write files (the layer searches) need
workers on the same filesystem: one machine, or a shared disk.

Ray is optional: ``pip install 'lminvert[ray]'``. Nothing imports it unless a Ray executor is asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import LminvertError
from .models.loading import LoadedModel
from .tasking import Executor, Plain, TaskRecord, WorkerSetup, ordered, run_task, since

__all__ = [
    "Executor",
    "InProcessExecutor",
    "ModelSetup",
    "Plain",
    "TaskRecord",
    "WorkerSetup",
    "executor_spec",
    "get_executor",
    "ordered",
    "run_task",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class InProcessExecutor:
    """Runs tasks one after the other in this process (torch already uses every core inside each task)."""

    name = "inprocess"
    workers = 1

    def __init__(self) -> None:
        self.records: list[TaskRecord] = []

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        return ordered(self.map_with(None, Plain(fn), tasks), len(tasks))

    def map_with(
        self, setup: WorkerSetup | None, fn: Callable[[Any, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[int, R]]:
        state = setup.here() if setup is not None and tasks else None
        start = time.time()
        for index, task in enumerate(tasks):
            _, result, record = run_task(state, fn, index, task)
            self.records.append(since(record, start))
            yield index, result

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ModelSetup:
    """A worker's copy of a loaded model: loaded there once, by name, and checked to have the same weights.

    In this process it is the model itself (``local``, never shipped). A model loaded with ``device="auto"``
    is loaded with ``auto`` on each worker too (a worker with a GPU uses it, one without runs on its CPU);
    otherwise a worker loads on the device type the model is on here (a CUDA model: the worker's own GPU).
    """

    name: str
    dtype: str
    device: str
    weights_hash: str
    seed: int | None = None
    local: LoadedModel | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return f"model:{self.name}:{self.seed}:{self.dtype}:{self.device}:{self.weights_hash}"

    @classmethod
    def of(cls, model: LoadedModel) -> ModelSetup:
        name, seed = model.name, None
        base, sep, suffix = model.name.rpartition("@")
        if sep and suffix.isdigit() and model.spec is not None:  # load_model(name, seed=...) labels it name@seed
            name, seed = base, int(suffix)
        device = "auto" if model.device_asked == "auto" else model.device.type
        return cls(name, model.dtype, device, model.weights_hash, seed, local=model)

    def here(self) -> LoadedModel:
        if self.local is None:
            return self.make()
        return self.local

    def make(self) -> LoadedModel:
        from .models.loading import load_model

        try:
            model = load_model(self.name, dtype=self.dtype, device=self.device, seed=self.seed)
        except LminvertError as exc:
            raise LminvertError(
                f"a worker cannot load model '{self.name}' ({exc}); a model made in memory cannot be sent to "
                "workers: save it (save_pretrained) and load it from that directory, or run without --ray"
            ) from None
        if model.weights_hash != self.weights_hash:
            raise LminvertError(
                f"model '{self.name}' loads with other weights on a worker than in this process "
                f"({model.weights_hash[:12]} != {self.weights_hash[:12]}): a model changed in memory cannot be "
                "sent to workers; save it to a directory and load it from there, or run without --ray"
            )
        return model

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "local": None}  # workers load their own copy


def get_executor(spec: str | Executor | None = None, **kwargs: Any) -> Executor:
    """The executor named by ``spec``.

    ``None``/``"inprocess"``: this process. ``"ray"``: a new local Ray instance; ``"ray:auto"``: the running
    cluster (``ray start --head``); ``"ray:HOST:PORT"`` or ``"ray://HOST:PORT"``: the cluster at that address.
    An :class:`Executor` is returned as is. ``kwargs`` go to :class:`~.ray_executor.RayExecutor`.
    """
    if spec is None or spec == "inprocess":
        return InProcessExecutor()
    if not isinstance(spec, str):
        return spec
    if spec == "ray" or spec.startswith(("ray:", "ray://")):
        address = None if spec == "ray" else spec if spec.startswith("ray://") else spec[len("ray:") :]
        from .ray_executor import RayExecutor  # imports Ray only now

        return RayExecutor(address=address or None, **kwargs)
    raise LminvertError(f"unknown executor '{spec}': use inprocess, ray, ray:auto or ray:HOST:PORT")


def executor_spec(ray: str | None) -> str:
    """The executor a ``--ray [ADDRESS]`` option names: absent -> in-process; no address -> a local Ray."""
    if ray is None:
        return "inprocess"
    if ray == "":
        return "ray"
    return ray if ray.startswith("ray://") else f"ray:{ray}"
