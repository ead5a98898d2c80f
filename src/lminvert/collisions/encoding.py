"""Filling a :class:`~.store.StateStore`: last-token states of prompts, or of every one-token continuation.

Both go through the layer probe (the one place that knows the architecture): prompts with batched, right-padded
full forwards that stop after the highest layer asked for; continuations with one KV cache per prefix, built
once, and batches of vocabulary tokens over it. States are stored as float32 whatever the model's dtype.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..encode import padded_batch
from ..models import LoadedModel
from .store import StateStore

log = logging.getLogger(__name__)


def _batches(ids: Sequence[Sequence[int]], order: list[int], batch_tokens: int) -> list[list[int]]:
    """Split ``order`` (sorted by length) into batches of at most ``batch_tokens`` padded tokens."""
    batches, current, width = [], [], 0
    for i in order:
        wider = max(width, len(ids[i]))
        if current and wider * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, wider = [], len(ids[i])
        current.append(i)
        width = wider
    if current:
        batches.append(current)
    return batches


def _pending(store: StateStore, max_chunks: int | None) -> tuple[list[int], int]:
    """The store's unfinished chunks (the first ``max_chunks`` of them) and how many rows they hold."""
    pending = store.pending()[:max_chunks]
    return pending, sum(store.chunk_range(c)[1] - store.chunk_range(c)[0] for c in pending)


def last_token_states(
    model: LoadedModel, ids: Sequence[Sequence[int]], layers: Sequence[int], batch_tokens: int = 4096
) -> dict[int, np.ndarray]:
    """``{layer: [len(ids), d]}`` float32 states of each prompt's last token (batched, sorted by length)."""
    probe = model.probe
    out = {layer: np.empty((len(ids), probe.hidden_size), dtype=np.float32) for layer in layers}
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    for batch in _batches(ids, order, batch_tokens):
        tokens, mask = padded_batch(ids, batch)
        states = probe.states(tokens, list(layers), attention_mask=mask)
        last = torch.tensor([len(ids[i]) - 1 for i in batch])
        rows = torch.arange(len(batch))
        for layer in layers:
            out[layer][batch] = states[layer][rows, last].float().cpu().numpy()
    return out


def encode_prompts(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    store: StateStore,
    batch_tokens: int = 4096,
    progress: bool = True,
    max_chunks: int | None = None,
) -> float:
    """Encode the store's pending chunks of ``ids``; returns seconds spent. ``max_chunks`` stops early."""
    pending, todo = _pending(store, max_chunks)
    if not pending:
        return 0.0
    start = time.perf_counter()
    bar = tqdm(total=todo, desc="encoding", unit="prompt", disable=None if progress else True, leave=False)
    for chunk in pending:
        lo, hi = store.chunk_range(chunk)
        store.write_chunk(chunk, last_token_states(model, ids[lo:hi], store.layers, batch_tokens))
        bar.update(hi - lo)
    bar.close()
    seconds = time.perf_counter() - start
    log.info("encoded %d prompts at %d layers in %.1f s", todo, len(store.layers), seconds)
    return seconds


def encode_continuations(
    model: LoadedModel,
    prefix_ids: Sequence[int],
    store: StateStore,
    progress: bool = True,
    max_chunks: int | None = None,
    desc: str = "continuations",
) -> float:
    """States of ``prefix + [v]`` for every vocabulary token ``v`` (store rows = token ids), one cache per prefix."""
    pending, todo = _pending(store, max_chunks)
    if not pending:
        return 0.0
    probe = model.probe
    start = time.perf_counter()
    prefix = probe.prefix(list(prefix_ids), max(store.layers))
    bar = tqdm(total=todo, desc=desc, unit="token", unit_scale=True, disable=None if progress else True, leave=False)
    with torch.no_grad():
        for chunk in pending:
            lo, hi = store.chunk_range(chunk)
            states = probe.continuation(prefix, token_ids=torch.arange(lo, hi), layers=store.layers)
            assert isinstance(states, dict)
            store.write_chunk(chunk, {layer: s.float().cpu().numpy() for layer, s in states.items()})
            bar.update(hi - lo)
    bar.close()
    seconds = time.perf_counter() - start
    log.info("encoded %d continuations of a %d-token prefix in %.1f s", todo, len(prefix_ids), seconds)
    return seconds


def _noise_summary(stored: dict[int, np.ndarray], again: dict[int, np.ndarray], rows: np.ndarray) -> dict[int, dict]:
    out = {}
    for layer, values in again.items():
        diff = np.asarray(stored[layer][rows], dtype=np.float64) - values.astype(np.float64)
        distance = np.sqrt((diff * diff).sum(axis=1))
        out[layer] = {"n": len(rows), "max": float(distance.max()), "median": float(np.median(distance))}
    return out


def prompt_rounding_noise(
    model: LoadedModel, ids: Sequence[Sequence[int]], store: StateStore, sample: int = 16, seed: int = 0
) -> dict[int, dict]:
    """Distance between stored states and the same ``sample`` prompts encoded again, in a batch of their own.

    Both are the same mathematical function of the same input; the distance is rounding only (GEMMs round
    differently with other batch shapes). Distances at or below this scale cannot be told from noise.
    """
    rows = np.sort(np.random.default_rng(seed).choice(len(ids), size=min(sample, len(ids)), replace=False))
    again = last_token_states(model, [ids[row] for row in rows], store.layers)
    return _noise_summary({layer: store.layer(layer) for layer in store.layers}, again, rows)


def continuation_rounding_noise(
    model: LoadedModel, prefix_ids: Sequence[int], store: StateStore, sample: int = 16, seed: int = 0
) -> dict[int, dict]:
    """Like :func:`prompt_rounding_noise` for continuations: ``sample`` tokens again, in one batch of their own."""
    rows = np.sort(np.random.default_rng(seed).choice(store.n, size=min(sample, store.n), replace=False))
    probe = model.probe
    prefix = probe.prefix(list(prefix_ids), max(store.layers))
    with torch.no_grad():
        states = probe.continuation(prefix, token_ids=torch.from_numpy(rows), layers=store.layers)
    assert isinstance(states, dict)
    again = {layer: s.float().cpu().numpy() for layer, s in states.items()}
    return _noise_summary({layer: store.layer(layer) for layer in store.layers}, again, rows)
