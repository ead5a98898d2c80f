"""The observer's plain forward, recomputed from the keys and values of a prefix it shares.

A confirmation (:mod:`lminvert.invert.search`) recomputes what the observer computed: the plain forward of the whole
observed sequence, shaped like the observer's, which reproduces the true token's state bit for bit where the kernels
are the observer's. Most of that forward is the prefix, the same from one confirmation to the next. On a CPU in half
precision every kernel of a block but the attention computes each row of a sequence alone (the same bits whatever
the number of rows: SmolLM2 in bfloat16 and float16, GEMMs of 1 to 40 rows), and the attention kernel's blocking
follows the sequence's length (an unpadded 11-token forward differs from the 20-token one at position 10; from 16
tokens on they agree). So the observer's states at positions ``s..`` are recomputed from the keys and values of
positions ``< s`` kept from an earlier such forward: only the rows ``s..`` run, and the attention runs at the
observer's shape (queries at their positions of a zero-filled block of the observed length, keys and values of the
later positions zero: the causal mask hides them). In float32 the CPU's GEMMs round differently for different
numbers of rows, so there (and on other devices, whose kernels are not measured) the whole sequence runs as before.
A model with sliding-window (or chunked) attention layers takes the shortcut for sequences no longer than its
smallest window, where every layer attends to every earlier position and transformers runs it unmasked like a full
layer (Gemma-3-270m in bfloat16, its last layer, 8 held-out prompts: 0.77x the median, the same tokens and verdicts:
docs/results.md); a longer sequence runs whole.

The engine's cached forwards at an attention sink in lminvert's own half-precision states run their attention at the
observer's shape too (:func:`shaped`: keys and values zero-filled to the observed length and masked; a sink's state
from a single query's kernel lay 69% of its norm off, SmolLM2 layer 30 in bfloat16).

Whether the shortcut reproduces the whole forward is not assumed: the first ``CHECKS`` times a probe takes it, the
whole forward runs beside it, and any differing bit turns the shortcut off for that probe (logged). (One check was not
enough: on a CPU with AMX float16 GEMMs the first shortcut from kept keys matched and later ones did not.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .hf_internals import attn_implementation, register_attention, sdpa_attention_forward, using_attention

log = logging.getLogger(__name__)
CHECKS = 4  # shortcuts from kept keys (prefixes of several lengths) checked against the whole forward before trusted
# rows a shortcut computes at the least: a CPU with AMX float16 GEMMs rounds a one-row product differently from the
# same row among others (SmolLM2 float16, a sequence's last position alone)
MIN_ROWS = 2

# the cached forwards of a half-precision model run at the observer's shape within the engine's search (:func:`shaped`;
# False: as transformers runs a cached forward)
SHAPED = True
ATTENTION = "lminvert_observed"  # the attention implementation's name while a shortcut forward runs
SHAPED_ATTENTION = "lminvert_shaped"  # ... while a cached forward runs at the observer's shape (:func:`shaped`)
_LENGTH: contextvars.ContextVar[int] = contextvars.ContextVar("observed_length")


def _placed(x: torch.Tensor, at: int, length: int) -> torch.Tensor:
    """``x`` ``[B, H, n, D]`` at positions ``at..at+n-1`` of a zero-filled ``[B, H, length, D]``."""
    full = x.new_zeros(*x.shape[:2], length, x.shape[3])
    full[:, :, at : at + x.shape[2]] = x
    return full


def _observed_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa at the observer's shape: ``query`` ``[B, H, n, D]`` holds positions ``s..s+n-1`` and ``key``/``value``
    ``[B, Hkv, s+n, D]`` positions ``0..s+n-1`` of a sequence observed at length ``_LENGTH``."""
    count, total = query.shape[2], key.shape[2]
    length = max(_LENGTH.get(), total)
    start = total - count
    query, key, value = _placed(query, start, length), _placed(key, 0, length), _placed(value, 0, length)
    out, _ = sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return out[:, start:total], None


def _shaped_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa as the observer ran it, for the rows a cached forward computes: ``query`` ``[B, H, n, D]`` holds positions
    ``s..s+n-1``, ``key``/``value`` ``[B, Hkv, s+n, D]`` positions ``0..s+n-1``, zero-filled to the observed length
    ``_LENGTH`` and masked beyond each row's own position, the heads grouped as the observer's unmasked call groups them
    (a sink's row: the observer's bits at layer 30, docs/results.md; cheaper than :func:`_observed_attention`'s
    zero-filled queries, which took about 1.6x the time per candidate on a layer-30 sink prompt)."""
    count, total = query.shape[2], key.shape[2]
    length = max(_LENGTH.get(), total)
    if length > total:
        key, value = _placed(key, 0, length), _placed(value, 0, length)
    rows = torch.arange(total - count, total, device=query.device)[:, None]
    mask = (torch.arange(length, device=query.device)[None] <= rows)[None, None]
    grouped = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=kwargs.get("scaling"), enable_gqa=grouped
    )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    """Make :data:`ATTENTION` selectable in transformers (once per process, when a shortcut forward first runs;
    importing lminvert registers nothing). Causal by shape: the observer had no mask."""
    register_attention(ATTENTION, _observed_attention, lambda *args, **kwargs: None)
    register_attention(SHAPED_ATTENTION, _shaped_attention, lambda *args, **kwargs: None)


@dataclass(frozen=True)
class PlainKeys:
    """Keys and values ``[1, Hkv, n, D]`` of blocks ``1..top`` at positions ``0..n-1`` of ``tokens``, as the
    observer-shaped plain forward computed them."""

    tokens: tuple[int, ...]
    keys: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def shared(self, sequence: list[int], upto: int) -> int:
        """How many leading positions of ``sequence`` (at most ``upto``) these keys hold."""
        n = 0
        for a, b in zip(self.tokens[:upto], sequence[:upto], strict=False):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class PlainRows:
    """States ``[B, n, d]`` of full observed sequences at positions ``start..start+n-1``, and their keys and values
    ``[B, Hkv, n, D]`` per block, from which a later forward may start (None where the whole sequence ran)."""

    start: int
    states: torch.Tensor
    kept: PlainKeys | None
    new: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None
    sequences: list[list[int]]

    def keys_of(self, row: int) -> PlainKeys | None:
        """Keys and values of the whole sequence ``row``, to start a later forward from."""
        if self.new is None:
            return None
        old = self.kept.keys if self.kept is not None and self.start else None
        keys = []
        for block, (k, v) in enumerate(self.new):
            k, v = k[row : row + 1], v[row : row + 1]
            if old is not None:
                k = torch.cat([old[block][0][:, :, : self.start], k], dim=2)
                v = torch.cat([old[block][1][:, :, : self.start], v], dim=2)
            keys.append((k, v))
        return PlainKeys(tuple(self.sequences[row]), tuple(keys))


class ObservedForward:
    """The plain forward of one probe with the shortcut above where it is allowed and, once checked, reproduces."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.window = self._window()  # sequences longer than this run whole (None: any length may take the shortcut)
        self.works: bool | None = None if self._allowed() else False  # None: not checked yet
        self.matched = 0  # shortcuts from kept keys that reproduced the whole forward so far

    def _allowed(self) -> bool:
        probe = self.probe
        if probe.device.type != "cpu" or probe.dtype not in (torch.bfloat16, torch.float16):
            return False
        return attn_implementation(probe.model.config) == "sdpa" and self.window != 0

    def _window(self) -> int | None:
        """The longest observed sequence whose every layer attends as a full causal layer: the smallest sliding window
        or attention chunk (Gemma-3: 512; a sequence no longer than it sees every earlier position in every layer,
        and transformers then runs those layers' attention unmasked, as the full layers'); None: no such layer; 0: a
        layer kind not known here (never the shortcut)."""
        config = self.probe.config
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds - {"full_attention", "sliding_attention", "chunked_attention"}:
            return 0
        windows = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")]
        sizes = [w for w in windows if isinstance(w, int) and w > 0]
        if kinds != {"full_attention"} and not sizes:
            return 0
        return min(sizes) if sizes else None

    def states(
        self, sequences: list[list[int]], layer, upto: int, kept: PlainKeys | None, stop: int | None = None
    ) -> PlainRows:
        """States of ``sequences`` (full observed length, equal lengths) at ``layer``, from position ``start`` on:
        ``start <= upto`` is how much of the first sequence ``kept`` holds (0 where the shortcut is off); with the
        shortcut, positions from ``stop`` on are not computed (their tokens still shape the kernels)."""
        if self.works is False or layer.top_block == 0 or (self.window is not None and len(sequences[0]) > self.window):
            return self._whole(sequences, layer)
        start = kept.shared(sequences[0], upto) if kept is not None else 0
        stop = len(sequences[0]) if stop is None else min(max(stop, upto + 1), len(sequences[0]))
        start = max(0, min(start, stop - MIN_ROWS))
        rows = self._from(sequences, layer, start, stop, kept)
        if self.works is None:  # checked against the whole forward until CHECKS shortcuts from kept keys matched
            whole = self._whole(sequences, layer)
            if not torch.equal(whole.states[:, start:stop], rows.states):
                self.works = False
                log.info("plain forwards run whole: the shortcut from kept keys does not reproduce them here")
                return whole
            if start:
                self.matched += 1
                self.works = True if self.matched >= CHECKS else None
        return rows

    def _whole(self, sequences: list[list[int]], layer) -> PlainRows:
        probe = self.probe
        states = probe.states(torch.tensor(sequences, device=probe.device), [layer])[layer]
        return PlainRows(0, states, None, None, sequences)

    def _from(self, sequences: list[list[int]], layer, start: int, stop: int, kept: PlainKeys | None) -> PlainRows:
        probe = self.probe
        count, length = len(sequences), len(sequences[0])
        cache = DynamicCache(config=probe.config)
        if start:
            assert kept is not None
            for block, (k, v) in enumerate(kept.keys):
                cache.update(
                    k[:, :, :start].expand(count, -1, -1, -1).contiguous(),
                    v[:, :, :start].expand(count, -1, -1, -1).contiguous(),
                    block,
                )
        ids = torch.tensor([row[start:stop] for row in sequences], device=probe.device)
        positions = torch.arange(start, stop, device=probe.device)[None].expand(count, -1)
        token = _LENGTH.set(length)
        try:
            _register()
            with torch.no_grad(), attention(probe, ATTENTION):
                out = probe._forward(
                    [layer], input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions
                )
        finally:
            _LENGTH.reset(token)
        new = tuple(
            (cache.layers[block].keys[:, :, start:], cache.layers[block].values[:, :, start:])
            for block in range(layer.top_block)
        )
        return PlainRows(start, out[layer], kept, new, [row[:stop] for row in sequences])


@contextlib.contextmanager
def shaped(probe, length: int | None):
    """Within: ``probe``'s cached forwards (continuations, chains, a prefix's growth) run their attention at the shape
    of an observed sequence of ``length`` positions, as the plain forward from kept keys above does, where that forward
    may take its shortcut (a CPU in half precision, sdpa, ``length`` within every sliding window); elsewhere, or with
    ``length`` None or :data:`SHAPED` off, nothing changes. Such a forward's attention rounds nearer the observer's, so
    a sink's candidates' states lie nearer the observed ones (SmolLM2 bfloat16, the true token at a sink: bit for bit
    at layer 30, where the unshaped state was 69% of the norm off; 1.9% off at a layer-15 sink, against 59.7%) and the
    true token is no longer among the last contenders re-measured by a plain forward. Speed only: the radii are
    measured on unshaped forwards (never inside this), the plain forwards that re-measure are unchanged, and every
    verdict is the acceptor's. Continuations are not packed within (:func:`.packing.attention_to_pack` packs under
    sdpa only)."""
    forward = probe._observed
    if not SHAPED or length is None or forward.works is False or not forward._allowed():
        yield
        return
    if forward.window is not None and length > forward.window:
        yield
        return
    _register()
    token = _LENGTH.set(length)
    try:
        with attention(probe, SHAPED_ATTENTION):
            yield
    finally:
        _LENGTH.reset(token)


@contextlib.contextmanager
def attention(probe, name: str):
    """The model's attention implementation switched to ``name`` (and the text model's, where it has its own config)."""
    configs = [probe.model.config] + ([probe.config] if probe.config is not probe.model.config else [])
    with using_attention(configs, name):
        yield
