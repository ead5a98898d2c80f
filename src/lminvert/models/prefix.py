"""Prefix KV caches of the layer probe (:mod:`.probe`), and the cached forwards over them.

A :class:`Prefix` holds the keys and values of blocks ``1..top`` of one or several prompt prefixes of equal length,
computed once; continuations are computed over it without copying it (:class:`_FrozenPrefixLayer`: a read-only view
broadcast over a batch) and a chosen one joins it from the keys and values its verification forward computed
(:class:`NewKeys`). The functions are the bodies of :class:`.probe.LayerProbe`'s prefix methods, whose docstrings
state the contracts; ``probe`` is a :class:`.probe.LayerProbe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from . import hooks
from .hf_internals import Cache, CacheLayerMixin
from .layers import Layer, LayerSpec


class _FrozenPrefixLayer(CacheLayerMixin):
    """Read-only view of one layer of a prefix cache, broadcast over a batch of continuations.

    ``update`` returns prefix keys/values concatenated with the new ones and stores nothing, so one prefix cache
    serves any number of candidate batches. One prefix row is broadcast (expanded) to every continuation; with
    several rows, ``rows[i]`` names the prefix of continuation ``i``.
    """

    def __init__(self, inner: CacheLayerMixin, rows: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.keys, self.values = inner.keys, inner.values
        self.is_initialized = True
        self.is_sliding = getattr(inner, "is_sliding", False)  # masks are sized per kind of layer (Gemma-2/3)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def _past(self, past: torch.Tensor, batch: int) -> torch.Tensor:
        if self.rows is None:
            return past.expand(batch, *past.shape[1:])
        return past.index_select(0, self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        assert self.keys is not None and self.values is not None
        self.new = (key_states, value_states)  # the continuations' own keys and values (see NewKeys)
        batch = key_states.shape[0]
        keys = torch.cat([self._past(self.keys, batch), key_states], dim=-2)
        values = torch.cat([self._past(self.values, batch), value_states], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return self.inner.get_max_length()


@dataclass(frozen=True)
class NewKeys:
    """The keys and values a batch of one-token continuations computed in each cached block (``[B, heads, 1,
    head_dim]`` per block, blocks ``1..top``): :meth:`LayerProbe.advance_from` grows a prefix by one chosen
    continuation per row from them, instead of a forward that would recompute them."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def take(self, index: torch.Tensor) -> NewKeys:
        """Rows ``index`` (copies: the batch they came from can be freed)."""
        return NewKeys(tuple((k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers))

    def row(self, index: int) -> NewKeys:
        """Row ``index`` (views)."""
        cut = slice(index, index + 1)
        return NewKeys(tuple((k[cut], v[cut]) for k, v in self.layers))

    def at(self, position: int) -> NewKeys:
        """The keys and values of one position of each row (of :meth:`LayerProbe.chains`' several)."""
        cut = slice(position, position + 1)
        return NewKeys(tuple((k[:, :, cut], v[:, :, cut]) for k, v in self.layers))

    @staticmethod
    def stack(parts: Sequence[NewKeys]) -> NewKeys:
        """Rows of several :class:`NewKeys`, in order."""
        return NewKeys(
            tuple(
                (torch.cat([p.layers[i][0] for p in parts]), torch.cat([p.layers[i][1] for p in parts]))
                for i in range(len(parts[0].layers))
            )
        )


@dataclass
class Prefix:
    """``N`` prompt prefixes of the same length whose KV caches (blocks 1..top) were computed once, as one batched
    cache (row ``i`` of every cache tensor is prefix ``i``). Most callers hold one row."""

    rows: list[list[int]]
    layer: Layer
    cache: Cache | None  # None while nothing is cached (the prefixes are empty, or every token of them is deferred)
    # the rows' last tokens whose keys and values are not in the cache yet (:meth:`LayerProbe.defer`); a forward over
    # the cache needs them first (:meth:`LayerProbe.catch_up`)
    behind: int = 0

    @property
    def length(self) -> int:
        return len(self.rows[0])

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def token_ids(self) -> list[int]:
        """The ids of a one-row prefix."""
        if len(self.rows) != 1:
            raise ValueError(f"this prefix holds {len(self.rows)} rows; read .rows")
        return self.rows[0]


def grown_rows(prefix: Prefix, token_ids: Sequence[int]) -> list[list[int]]:
    """The prefix's rows, each grown by its token (one per row)."""
    if len(token_ids) != prefix.size:
        raise ValueError(f"one token per prefix row: got {len(token_ids)} for {prefix.size} rows")
    return [[*row, int(t)] for row, t in zip(prefix.rows, token_ids, strict=True)]


def cache_of(probe, prefix: Prefix) -> Cache:
    """The prefix's cache, or a new empty one for an empty prefix."""
    return prefix.cache if prefix.cache is not None else DynamicCache(config=probe.config)


def prefixes(probe, rows: Sequence[Sequence[int]], resolved: Layer) -> Prefix:
    """One batched KV cache (blocks ``1..resolved``) of several prefixes of the same length, in one forward."""
    ids = [[int(t) for t in row] for row in rows]
    if not ids or len({len(row) for row in ids}) != 1:
        raise ValueError("give at least one prefix; all prefixes must have the same length")
    if not ids[0]:
        return Prefix(ids, resolved, None)
    cache = DynamicCache(config=probe.config)
    tensor = torch.tensor(ids, device=probe.device)
    probe.check_ids(tensor)
    with torch.no_grad(), probe._cached_math():
        probe._forward(
            [Layer(resolved.top_block, probe.n_layers)], input_ids=tensor, past_key_values=cache, use_cache=True
        )
    return Prefix(ids, resolved, cache)


def advance_rows(probe, prefix: Prefix, token_ids: Sequence[int]) -> tuple[Prefix, torch.Tensor]:
    """Every row grows by its token (one forward, the cache is taken over); the new tokens' states ``[N, d]``."""
    rows = grown_rows(prefix, token_ids)
    top = Layer(prefix.layer.top_block, probe.n_layers)
    cache = cache_of(probe, prefix)
    tensor = torch.tensor([row[len(row) - prefix.behind - 1 :] for row in rows], device=probe.device)
    probe.check_ids(tensor)
    with torch.no_grad(), probe._cached_math():
        out = probe._forward([top], input_ids=tensor, past_key_values=cache, use_cache=True)
    return Prefix(rows, prefix.layer, cache), out[top][:, -1]


def defer(prefix: Prefix, token_ids: Sequence[int]) -> Prefix:
    """Every row grows by its token without a forward (:meth:`.probe.LayerProbe.defer`); an empty prefix's too (the
    forward that catches up then computes every token)."""
    return Prefix(grown_rows(prefix, token_ids), prefix.layer, prefix.cache, prefix.behind + 1)


def catch_up(probe, prefix: Prefix) -> bool:
    """Put the deferred tokens' keys and values in the cache (in place); whether a forward ran."""
    if not prefix.behind:
        return False
    grown, _ = probe.advance_rows(
        Prefix([row[:-1] for row in prefix.rows], prefix.layer, prefix.cache, prefix.behind - 1),
        [row[-1] for row in prefix.rows],
    )
    prefix.cache, prefix.behind = grown.cache, 0
    return True


def advance_from(probe, prefix: Prefix, token_ids: Sequence[int], new: NewKeys) -> Prefix:
    """Every row grows by its token from keys and values ``new`` already computed: no forward runs."""
    if prefix.behind:
        raise ValueError("the prefix has deferred tokens: catch_up first")
    rows = grown_rows(prefix, token_ids)
    if new.layers[0][0].shape[0] != prefix.size:
        raise ValueError(f"one row of keys per prefix row ({prefix.size})")
    if len(new.layers) != prefix.layer.top_block:
        raise ValueError(f"keys and values of {prefix.layer.top_block} blocks needed, got {len(new.layers)}")
    cache = cache_of(probe, prefix)
    _put(cache, new)
    return Prefix(rows, prefix.layer, cache)


def _put(cache, new: NewKeys) -> None:
    """``new``'s keys and values into ``cache``, block by block from the first."""
    for block, (keys, values) in enumerate(new.layers):
        cache.update(keys, values, block)


def advance_above(
    probe, prefix: Prefix, token_ids: Sequence[int], new: NewKeys, states: torch.Tensor, layer: Layer
) -> tuple[Prefix, torch.Tensor]:
    """Every row grows by its token whose keys and values in blocks ``1..layer`` (``new``) and state at ``layer``
    (``states`` ``[N, d]``) were computed already: only the blocks above ``layer`` run, on the states (one forward, none
    at the last block), then the lower blocks' keys and values join the cache. Returns the grown prefix and the new
    tokens' states after the final norm ``[N, d]``."""
    if prefix.behind or prefix.cache is None:
        raise ValueError("advance_above grows a cached prefix with no deferred tokens")
    if int(layer) < 1 or len(new.layers) != layer.top_block or layer.top_block > prefix.layer.top_block:
        raise ValueError(f"keys and values of blocks 1..{int(layer)} (within the prefix's) needed")
    rows = grown_rows(prefix, token_ids)
    final = hooks.final_from(probe, states[:, None, :], layer, cache=prefix.cache)[:, -1]
    _put(prefix.cache, new)
    return Prefix(rows, prefix.layer, prefix.cache), final


def select(probe, prefix: Prefix, keep: Sequence[int]) -> Prefix:
    """Only rows ``keep`` of the prefix (its cache is taken over)."""
    if list(keep) == list(range(prefix.size)):
        return prefix
    if prefix.cache is not None:
        prefix.cache.batch_select_indices(torch.tensor(list(keep), dtype=torch.long, device=probe.device))
    return Prefix([prefix.rows[i] for i in keep], prefix.layer, prefix.cache, prefix.behind)


def continue_prefix(
    probe,
    prefix: Prefix,
    embeds: torch.Tensor,
    layers: Sequence[LayerSpec] | None,
    rows: torch.Tensor | None,
    keys: bool,
    lengths: Sequence[int] | None = None,
) -> tuple[dict[Layer, torch.Tensor], NewKeys | None]:
    """States ``[B, K, d]`` of input vectors ``embeds`` ``[B, K, d]`` appended to the cached prefix (the shared
    forward of :meth:`.probe.LayerProbe.continuation` and :meth:`~.probe.LayerProbe.chains`), and with ``keys`` their
    keys and values.

    Over a cached prefix the continuations are packed (:meth:`.probe.LayerProbe._packing`, :mod:`.packing`): up to
    ``pack`` tokens of continuations of the same prefix row share one row of the forward, each attending to the
    prefix and to its own earlier tokens only (a block-diagonal mask, positions given explicitly), so the prefix's
    keys and values are read once per packed row instead of being copied for every continuation. The mask makes
    every state that of its own continuation; only the attention kernels' rounding differs (the verification radii
    are measured through this very path, :mod:`lminvert.invert.tolerance`)."""
    if prefix.behind:
        raise ValueError("the prefix has deferred tokens: catch_up first")
    wanted = [prefix.layer] if layers is None else probe.layers(layers)
    if max(wanted) > prefix.layer and prefix.cache is not None:
        raise ValueError("continuation layers must not exceed the prefix's layer")
    if keys and max(wanted) != prefix.layer:
        raise ValueError("keys=True needs the states at the prefix's layer (its blocks' keys come from that forward)")
    kwargs: dict = {"inputs_embeds": embeds.to(probe.dtype), "use_cache": prefix.cache is not None}
    views: list[_FrozenPrefixLayer] = []
    fresh: DynamicCache | None = None  # an empty prefix: the continuations' keys and values are collected here
    packing = probe._packing(prefix, embeds.shape[0], embeds.shape[1], rows, lengths)
    if prefix.cache is not None:
        index = None if rows is None else rows.to(probe.device)
        if packing is not None:
            index, kwargs = packing.rows, {**kwargs, **packing.inputs(embeds.to(probe.dtype))}
        views = [_FrozenPrefixLayer(layer, index) for layer in prefix.cache.layers]
        kwargs["past_key_values"] = Cache(layers=views)
    elif keys:
        fresh = DynamicCache(config=probe.config)
        kwargs.update(past_key_values=fresh, use_cache=True)
    with torch.set_grad_enabled(embeds.requires_grad), probe._cached_math():
        out = probe._forward(wanted, **kwargs)
    if packing is not None:
        out = {layer: packing.states(state) for layer, state in out.items()}
    if not keys:
        return out, None
    top = prefix.layer.top_block
    if fresh is not None:
        computed = [(layer.keys, layer.values) for layer in fresh.layers[:top] if layer.keys is not None]
    else:
        computed = [view.new for view in views[:top] if hasattr(view, "new")]
        if packing is not None:
            computed = [(packing.heads(k), packing.heads(v)) for k, v in computed]
    complete = top > 0 and len(computed) == top  # layer 0: no block runs
    return out, (NewKeys(tuple(computed)) if complete else None)
