"""Filling a :class:`~.store.StateStore` from the forward stage, and measuring the rounding noise of what it holds.

* :func:`fill_with_prompts` - last-token states of prompts (the collision search);
* :func:`fill_with_continuations` - ``prefix + [v]`` for every vocabulary token ``v`` (the exhaustive test).

Both only call :mod:`lminvert.forward`; rows are written in the store's chunks, so an interrupted run resumes
with the chunks it had not finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..forward import last_token_states, vocabulary_states
from ..models import Layer, LoadedModel
from .store import StateStore

log = logging.getLogger(__name__)


def _pending(store: StateStore) -> tuple[list[int], int]:
    """The store's unfinished chunks and how many rows they hold."""
    pending = store.pending()
    return pending, sum(store.chunk_range(c)[1] - store.chunk_range(c)[0] for c in pending)


def fill_with_prompts(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    store: StateStore,
    layers: Sequence[Layer],
    batch_tokens: int = 4096,
    progress: bool = True,
) -> float:
    """Encode the store's pending chunks of ``ids`` (last-token states); returns seconds spent."""
    pending, todo = _pending(store)
    if not pending:
        return 0.0
    start = time.perf_counter()
    bar = tqdm(total=todo, desc="encoding", unit="prompt", disable=None if progress else True, leave=False)
    for chunk in pending:
        lo, hi = store.chunk_range(chunk)
        states = last_token_states(model, ids[lo:hi], layers, batch_tokens)
        store.write_chunk(chunk, {int(layer): values for layer, values in states.items()})
        bar.update(hi - lo)
    bar.close()
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
) -> float:
    """States of ``prefix + [v]`` for every vocabulary token ``v`` (store rows = token ids); returns seconds."""
    pending, todo = _pending(store)
    if not pending:
        return 0.0
    start = time.perf_counter()
    tokens = torch.cat([torch.arange(*store.chunk_range(chunk)) for chunk in pending])
    bar = tqdm(total=todo, desc=desc, unit="token", unit_scale=True, disable=None if progress else True, leave=False)
    batches = vocabulary_states(model, prefix_ids, layers, tokens=tokens, batch=store.chunk_size)
    for chunk, (ids, states) in zip(pending, batches, strict=True):
        assert int(ids[0]) == store.chunk_range(chunk)[0]
        store.write_chunk(chunk, {int(layer): s.numpy() for layer, s in states.items()})
        bar.update(len(ids))
    bar.close()
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
