"""Continuations packed side by side into rows of a cached forward over a prefix (:class:`_Packing`).

Over a long prefix, up to ``PACK`` tokens of continuations of the same prefix row share one row of the forward, each
attending to the prefix and to its own earlier tokens only (a block-diagonal mask, positions given explicitly), so
the prefix's keys and values are read once per packed row instead of being copied for every continuation. The
functions are the bodies of :class:`.probe.LayerProbe`'s packing methods; ``probe`` is a :class:`.probe.LayerProbe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .hf_internals import attn_implementation
from .prefix import Prefix

PACK = 64  # continuation tokens per packed row of a cached forward (:func:`.prefix.continue_prefix`); 0: one row each
# Packing pays where the copies it saves are large: from a prefix of PACK tokens and PACKED_FROM copied prefix positions
# (continuation tokens x prefix length); measured: docs/history.md ("Constants")
PACKED_FROM = 2048
PACKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask as the probe builds it


@dataclass(frozen=True)
class _Packing:
    """Continuations packed side by side into rows of a cached forward (:func:`.prefix.continue_prefix`): row ``i``
    continues prefix row ``rows[i]`` with up to ``width`` tokens of continuations, each a block that attends to the
    prefix and to its own earlier tokens only. Unused places hold a zero input that attends to the prefix and itself
    (no attention row is empty; its state is never read). ``flat[b, j]`` is where token ``j`` of continuation ``b``
    sits in the flattened ``[rows * Q]`` (past a continuation's length: its last token's place)."""

    rows: torch.Tensor | None  # [R] the prefix row of each packed row (None: one prefix row, broadcast)
    flat: torch.Tensor  # [B, longest]
    given: torch.Tensor  # [tokens given] indices into the flattened [B * longest] inputs of the tokens that exist
    position_ids: torch.Tensor  # [R, Q]
    mask: torch.Tensor  # [R, 1, Q, prefix + Q]: True / 0 where a query may attend

    @staticmethod
    def build(
        prefix: Prefix,
        owners: list[int],
        lengths: list[int],
        width: int,
        device: torch.device,
        additive: torch.dtype | None,
    ) -> _Packing:
        """Pack continuations whose prefix rows are ``owners`` and whose token counts are ``lengths`` (one each),
        up to ``width`` tokens per packed row; ``additive``: the mask as additive floats of that dtype (eager
        attention) instead of booleans."""
        by_owner: dict[int, list[int]] = {}
        for b, owner in enumerate(owners):
            by_owner.setdefault(owner, []).append(b)
        packs: list[tuple[int, list[int]]] = []
        for owner, ids in by_owner.items():
            current: list[int] = []
            filled = 0
            for b in ids:
                if current and filled + lengths[b] > width:
                    packs.append((owner, current))
                    current, filled = [], 0
                current.append(b)
                filled += lengths[b]
            packs.append((owner, current))
        queries = max(sum(lengths[b] for b in ids) for _, ids in packs)
        longest = max(lengths)
        start, block, offset = [0] * len(owners), [], []
        for p, (_, ids) in enumerate(packs):
            used = 0
            for b in ids:
                start[b] = p * queries + used
                block += [b] * lengths[b]
                offset += range(lengths[b])
                used += lengths[b]
            block += range(-1 - used, -1 - queries, -1)  # each unused place a block of its own
            offset += [0] * (queries - used)
        count = torch.tensor(lengths)
        flat = torch.tensor(start)[:, None] + torch.minimum(torch.arange(longest), count[:, None] - 1)
        given = (torch.arange(longest) < count[:, None]).reshape(-1).nonzero().squeeze(1)
        blocks = torch.tensor(block, device=device).reshape(len(packs), queries)
        step = torch.arange(queries, device=device)
        own = (blocks[:, :, None] == blocks[:, None, :]) & (step[None, None, :] <= step[None, :, None])
        length = prefix.length
        mask = torch.cat([torch.ones(len(packs), queries, length, dtype=torch.bool, device=device), own], dim=2)
        mask = mask[:, None]
        if additive is not None:
            mask = torch.zeros(mask.shape, dtype=additive, device=device).masked_fill(~mask, torch.finfo(additive).min)
        rows = None if prefix.size == 1 else torch.tensor([owner for owner, _ in packs], device=device)
        positions = length + torch.tensor(offset, device=device).reshape(len(packs), queries)
        return _Packing(rows, flat.to(device), given.to(device), positions, mask)

    @property
    def shape(self) -> tuple[int, int]:
        return self.position_ids.shape[0], self.position_ids.shape[1]

    def inputs(self, embeds: torch.Tensor) -> dict:
        """The forward's arguments for continuations' input vectors ``embeds`` ``[B, longest, d]``."""
        packed = embeds.new_zeros(self.shape[0] * self.shape[1], embeds.shape[-1])
        flat, inputs = self.flat.reshape(-1)[self.given], embeds.reshape(-1, embeds.shape[-1])[self.given]
        packed = packed.index_put((flat,), inputs)
        return {
            "inputs_embeds": packed.reshape(*self.shape, -1),
            "attention_mask": self.mask,
            "position_ids": self.position_ids,
        }

    def states(self, packed: torch.Tensor) -> torch.Tensor:
        """``[B, longest, d]`` of a packed forward's ``[R, Q, d]``."""
        return packed.reshape(-1, packed.shape[-1])[self.flat]

    def heads(self, packed: torch.Tensor) -> torch.Tensor:
        """Keys or values ``[B, heads, longest, head_dim]`` of a packed forward's ``[R, heads, Q, head_dim]``."""
        by_place = packed.transpose(1, 2).reshape(-1, packed.shape[1], packed.shape[-1])
        return by_place[self.flat].transpose(1, 2)


def packing_for(
    probe,
    prefix: Prefix,
    batch: int,
    tokens: int,
    rows: torch.Tensor | None,
    lengths: Sequence[int] | None = None,
) -> _Packing | None:
    """How ``batch`` continuations of ``tokens`` tokens each (or of ``lengths``) over a cached prefix are packed
    into rows, or None (one row each): where the attention cannot take them (:func:`attention_to_pack`) or, for
    continuations of equal lengths, where packing would not pay (a prefix shorter than ``pack``, or fewer than
    ``packed_from`` prefix positions copied; ``packed_from = 0`` packs whatever can be packed, as
    :func:`.always_packed` does). Chains of different lengths are packed wherever they can be: only their own
    tokens are computed."""
    copied = batch * tokens * prefix.length
    if lengths is None and probe.packed_from > 0 and (prefix.length < probe.pack or copied < probe.packed_from):
        return None
    width = max(probe.pack, tokens)
    attention = attention_to_pack(probe, prefix, width)
    if attention is None:
        return None
    owners = [0] * batch if rows is None else rows.tolist()
    counts = [tokens] * batch if lengths is None else list(lengths)
    additive = probe.dtype if attention == "eager" else None
    return _Packing.build(prefix, owners, counts, width, probe.device, additive)


def attention_to_pack(probe, prefix: Prefix, width: int) -> str | None:
    """The attention implementation that will take packed rows of ``width`` tokens over ``prefix``, or None:
    without a cache (nothing to share), with packing off, with an implementation that takes no custom 4D mask,
    or where a sliding window or attention chunk could end inside the packed row (the mask would not repeat it)."""
    if prefix.cache is None or probe.pack <= 0:
        return None
    attention = attn_implementation(probe.model.config)
    if attention not in PACKED_ATTENTION:
        return None
    windows = [getattr(probe.config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    if any(isinstance(w, int) and w > 0 and prefix.length + width > w for w in windows):
        return None
    return attention
