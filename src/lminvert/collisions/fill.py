"""Filling a :class:`~.store.StateStore` from the forward stage, and measuring the rounding noise of what it holds.

* :func:`fill_with_prompts` - last-token states of prompts (the collision search);
* :func:`fill_with_continuations` - ``prefix + [v]`` for every vocabulary token ``v`` (the exhaustive test).

Both only call :mod:`lminvert.forward`; each chunk of the store is one task of an executor (the model loaded once
per worker), written as it arrives, so an interrupted run resumes with the chunks it had not finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..executors import Executor, InProcessExecutor, ModelSetup
from ..forward import last_token_states, vocabulary_states
from ..models import Layer, LoadedModel
from .store import StateStore

log = logging.getLogger(__name__)


def _pending(store: StateStore) -> tuple[list[int], int]:
    """The store's unfinished chunks and how many rows they hold."""
    pending = store.pending()
    return pending, sum(store.chunk_range(c)[1] - store.chunk_range(c)[0] for c in pending)


@dataclass(frozen=True)
class _Prompts:
    """One store chunk of prompts -> their last-token states (runs wherever the executor sends it)."""

    layers: tuple[Layer, ...]
    batch_tokens: int

    def __call__(self, model: LoadedModel, ids: Sequence[Sequence[int]]) -> dict[int, np.ndarray]:
        states = last_token_states(model, ids, self.layers, self.batch_tokens)
        return {int(layer): values for layer, values in states.items()}


@dataclass(frozen=True)
class _Continuations:
    """One store chunk of vocabulary tokens -> the states of ``prefix + [v]`` for each (one batch)."""

    prefix_ids: tuple[int, ...]
    layers: tuple[Layer, ...]

    def __call__(self, model: LoadedModel, rows: tuple[int, int]) -> dict[int, np.ndarray]:
        tokens = torch.arange(*rows)
        ((_, states),) = vocabulary_states(model, self.prefix_ids, self.layers, tokens=tokens, batch=len(tokens))
        return {int(layer): s.numpy() for layer, s in states.items()}


def _fill(
    model: LoadedModel,
    store: StateStore,
    fn: Callable[[LoadedModel, Any], dict[int, np.ndarray]],
    task: Callable[[int, int], Any],
    executor: Executor | None,
    bar: tqdm,
) -> int:
    """Compute the store's pending chunks (``fn(model, task(lo, hi))`` each, on the executor's workers) and
    write each one as it arrives; returns the rows written."""
    pending = store.pending()
    tasks = [task(*store.chunk_range(chunk)) for chunk in pending]
    runner = executor if executor is not None else InProcessExecutor()
    written = 0
    for index, rows in runner.map_with(ModelSetup.of(model), fn, tasks):
        lo, hi = store.chunk_range(pending[index])
        store.write_chunk(pending[index], rows)
        bar.update(hi - lo)
        written += hi - lo
    bar.close()
    return written


def fill_with_prompts(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    store: StateStore,
    layers: Sequence[Layer],
    batch_tokens: int = 4096,
    progress: bool = True,
    executor: Executor | None = None,
) -> float:
    """Encode the store's pending chunks of ``ids`` (last-token states); returns seconds spent."""
    pending, todo = _pending(store)
    if not pending:
        return 0.0
    start = time.perf_counter()
    bar = tqdm(total=todo, desc="encoding", unit="prompt", disable=None if progress else True, leave=False)
    fn = _Prompts(tuple(layers), batch_tokens)
    _fill(model, store, fn, lambda lo, hi: [tuple(x) for x in ids[lo:hi]], executor, bar)
    seconds = time.perf_counter() - start
    log.info("encoded %d prompts at %d layers in %.1f s", todo, len(layers), seconds)
    return seconds


def fill_with_continuations(
    model: LoadedModel,
    prefix_ids: Sequence[int],
    store: StateStore,
    layers: Sequence[Layer],
    progress: bool = True,
    desc: str = "continuations",
    executor: Executor | None = None,
) -> float:
    """States of ``prefix + [v]`` for every vocabulary token ``v`` (store rows = token ids); returns seconds.

    Each chunk of the store is one batch of continuations over the prefix's KV cache (built per chunk, which
    costs one prefix forward per ``chunk_size`` continuations and lets chunks run on different workers).
    """
    pending, todo = _pending(store)
    if not pending:
        return 0.0
    start = time.perf_counter()
    bar = tqdm(total=todo, desc=desc, unit="token", unit_scale=True, disable=None if progress else True, leave=False)
    fn = _Continuations(tuple(int(t) for t in prefix_ids), tuple(layers))
    _fill(model, store, fn, lambda lo, hi: (lo, hi), executor, bar)
    seconds = time.perf_counter() - start
    log.info("encoded %d continuations of a %d-token prefix in %.1f s", todo, len(prefix_ids), seconds)
    return seconds


def _rounding_summary(store: StateStore, again: dict[Layer, np.ndarray], rows: np.ndarray) -> dict[str, dict]:
    out = {}
    for layer, values in again.items():
        diff = np.asarray(store.layer(int(layer))[rows], dtype=np.float64) - values.astype(np.float64)
        distance = np.sqrt((diff * diff).sum(axis=1))
        out[str(int(layer))] = {"n": len(rows), "max": float(distance.max()), "median": float(np.median(distance))}
    return out


def prompt_rounding_noise(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    store: StateStore,
    layers: Sequence[Layer],
    sample: int = 16,
    seed: int = 0,
) -> dict[str, dict]:
    """Distance between stored states and the same ``sample`` prompts encoded again, in a batch of their own.

    Both are the same mathematical function of the same input; the distance is rounding only (GEMMs round
    differently with other batch shapes). Distances at or below this scale cannot be told from noise.
    Keys: layer indices as text.
    """
    rows = np.sort(np.random.default_rng(seed).choice(len(ids), size=min(sample, len(ids)), replace=False))
    again = last_token_states(model, [ids[row] for row in rows], layers)
    return _rounding_summary(store, again, rows)


def continuation_rounding_noise(
    model: LoadedModel,
    prefix_ids: Sequence[int],
    store: StateStore,
    layers: Sequence[Layer],
    sample: int = 16,
    seed: int = 0,
) -> dict[str, dict]:
    """Like :func:`prompt_rounding_noise` for continuations: ``sample`` tokens again, in one batch of their own."""
    rows = np.sort(np.random.default_rng(seed).choice(store.n, size=min(sample, store.n), replace=False))
    ((_, states),) = vocabulary_states(model, prefix_ids, layers, tokens=torch.from_numpy(rows), batch=len(rows))
    return _rounding_summary(store, {layer: s.numpy() for layer, s in states.items()}, rows)
