"""What every executor shares (:mod:`.executors` in this process, :mod:`.ray_executor` on a cluster): the task
protocol, its timing records and the helpers both run tasks with. Nothing here imports an executor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class WorkerSetup(Protocol):
    """What a worker makes once and hands to every task it runs (``key`` names it in the worker's cache)."""

    key: str

    def make(self) -> Any: ...

    def here(self) -> Any: ...


@dataclass(frozen=True)
class TaskRecord:
    """One finished task: which worker ran it, when (seconds since the map began) and for how long."""

    index: int
    worker: str
    started: float
    seconds: float
    finished: float


class Executor(Protocol):
    name: str
    workers: int  # tasks it runs at once
    records: list[TaskRecord]

    def map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]: ...

    def map_with(
        self, setup: WorkerSetup | None, fn: Callable[[Any, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[int, R]]: ...


def run_task(state: Any, fn: Callable[[Any, T], R], index: int, task: T) -> tuple[int, R, TaskRecord]:
    """Run one task where it was sent and time it (shared by both executors)."""
    began = time.time()
    result = fn(state, task)
    seconds = time.time() - began
    return index, result, TaskRecord(index, f"{os.uname().nodename}:{os.getpid()}", began, seconds, began + seconds)


@dataclass(frozen=True)
class Plain:
    """``fn(task)`` as a ``fn(state, task)`` that ignores the worker's state."""

    fn: Callable[[Any], Any]

    def __call__(self, state: Any, task: Any) -> Any:
        return self.fn(task)


def ordered(stream: Iterator[tuple[int, R]], n: int) -> list[R]:
    """The results of a :meth:`Executor.map_with` stream, in task order."""
    out: list[Any] = [None] * n
    for index, result in stream:
        out[index] = result
    return out


def since(record: TaskRecord, start: float) -> TaskRecord:
    """``record`` with its times counted from ``start`` (when the map began)."""
    return TaskRecord(record.index, record.worker, record.started - start, record.seconds, record.finished - start)
