"""The Ray executor: the same interface as :class:`~.executors.InProcessExecutor`, on a Ray cluster.

Work runs on a fixed pool of actors (``workers`` of them, ``cpus_per_worker`` CPUs and, where the cluster has
GPUs, one GPU each). An actor makes each :class:`~.tasking.WorkerSetup` once (a model is loaded once per
worker) and keeps it for every later task. Ray's :class:`~ray.util.ActorPool` hands tasks to idle actors and
yields results as they finish. A worker process that dies is restarted by Ray (always: deaths are counted per
task, not over the worker's life, so a long run survives any number of spread-out failures) and its task
retried up to ``retries`` times (``max_task_retries``); a failure of the task itself (an error in lminvert) is
not retried and is raised here.

This module imports Ray: :func:`lminvert.executors.get_executor` imports it only when Ray is asked for.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .errors import LminvertError
from .tasking import Plain, TaskRecord, WorkerSetup, ordered, run_task, since

try:
    import ray
    from ray.util import ActorPool
except ImportError:
    raise LminvertError("--ray needs Ray: pip install 'lminvert[ray]' (or run without --ray)") from None

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

RETRIES = 3  # retries of a task whose worker died running it (the worker itself is always restarted)


class Worker:
    """One Ray actor: holds what its setups made (a loaded model, ...) and runs tasks with it."""

    def __init__(self, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.made: dict[str, Any] = {}

    def run(self, setup: WorkerSetup | None, fn: Callable[[Any, Any], Any], index: int, task: Any) -> Any:
        state = None
        if setup is not None:
            if setup.key not in self.made:
                self.made[setup.key] = setup.make()
            state = self.made[setup.key]
        return run_task(state, fn, index, task)

    def ready(self) -> str:
        import os

        return f"{os.uname().nodename}:{os.getpid()}"


def _check_reachable(address: str) -> None:
    """A one-line error now for an address nothing listens on (Ray itself would retry for minutes)."""
    if address == "auto":
        return
    target = address[len("ray://") :] if address.startswith("ray://") else address
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LminvertError(f"bad Ray address '{address}': use auto, HOST:PORT (ray start --head prints it)")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as exc:
        raise LminvertError(
            f"no Ray cluster at {address} ({exc.strerror or exc}): start one with `ray start --head` "
            "or check the address"
        ) from None


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (``auto``: the running one), or start a local one (``None``)."""
    if ray.is_initialized():
        return
    if address is not None:
        _check_reachable(address)
    try:
        if address is None:
            ray.init(log_to_driver=False, include_dashboard=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LminvertError(f"could not join the Ray cluster at {address} ({first}): check `ray status`") from None


class RayExecutor:
    """Runs tasks on a pool of Ray actors (joins a running cluster when ``address`` is given).

    ``workers``: the pool size (default: as many as the cluster's GPUs, or its CPUs / ``cpus_per_worker``).
    ``gpus_per_worker``: default 1 where the cluster has GPUs, else 0.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float | None = None,
        retries: int = RETRIES,
    ) -> None:
        if workers is not None and workers < 1:
            raise LminvertError("--workers must be at least 1")
        connect(address)
        resources = ray.cluster_resources()
        gpus = float(resources.get("GPU", 0))
        self.gpus_per_worker = (1.0 if gpus >= 1 else 0.0) if gpus_per_worker is None else float(gpus_per_worker)
        self.cpus_per_worker = float(cpus_per_worker)
        if workers is None:
            by_cpu = int(float(resources.get("CPU", 1)) // self.cpus_per_worker)
            workers = int(gpus // self.gpus_per_worker) if self.gpus_per_worker else by_cpu
        self.workers = max(1, workers)
        self.retries = retries
        self.records: list[TaskRecord] = []
        self._actors: list[Any] = []
        log.info("Ray: %d workers (%.3g CPU, %.3g GPU each) on %s", self.workers, cpus_per_worker,
                 self.gpus_per_worker, {k: v for k, v in resources.items() if k in ("CPU", "GPU")})  # fmt: skip

    def _pool(self) -> list[Any]:
        if not self._actors:
            actor = ray.remote(Worker).options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                max_restarts=-1,  # a worker's deaths are limited per task (below), not over its life
                max_task_retries=self.retries,
            )
            self._actors = [actor.remote(int(self.cpus_per_worker)) for _ in range(self.workers)]
            ray.get([a.ready.remote() for a in self._actors])
        return self._actors

    def worker_ids(self) -> list[str]:
        """``host:pid`` of each worker process now."""
        return list(ray.get([a.ready.remote() for a in self._pool()]))

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        return ordered(self.map_with(None, Plain(fn), tasks), len(tasks))

    def map_with(
        self, setup: WorkerSetup | None, fn: Callable[[Any, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[int, R]]:
        if not tasks:
            return
        pool = ActorPool(self._pool())
        start = time.time()
        results = pool.map_unordered(lambda actor, item: actor.run.remote(setup, fn, *item), list(enumerate(tasks)))
        try:
            for index, result, record in results:
                self.records.append(since(record, start))
                yield index, result
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, LminvertError):
                raise LminvertError(str(cause)) from None
            raise
        except ray.exceptions.RayActorError as exc:
            raise LminvertError(
                f"a Ray worker died {self.retries + 1} times running the same task ({type(exc).__name__}); "
                "the finished work is kept: rerun the same command to resume"
            ) from None

    def close(self) -> None:
        """Stop this executor's workers (the cluster itself keeps running)."""
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
