"""Keys and values as a KV cache stores them, for the families whose attention projects ``k_proj``/``v_proj`` and
rotates keys by a rotary embedding (Llama, Qwen2, Gemma3, SmolLM2, ...).

Block ``b`` (1-based) caches ``K = RoPE_t(k_proj(norm(h)))`` and ``V = v_proj(norm(h))`` of its input ``h``, the
layer-``b-1`` state. This module gives the three views an audit needs, all as ``[T, D]`` rows (keys of every KV head,
then values, flattened):

* :meth:`KVBlock.cached` - what a deployment's cache holds after a forward (transformers' own ``DynamicCache``);
* :meth:`KVBlock.rows` - the same rows computed from layer-``b-1`` states ``[n, d]`` at a given position: the keys
  and values of one position are a function of its state alone (the rotation depends on the position only, and is
  orthogonal: distances between rows are kept);
* :meth:`KVBlock.replaced` - a context in which the block computes given cache rows instead (to measure what a
  defended cache costs the model's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from ..errors import LminvertError
from .loading import LoadedModel


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_turn(
    rotary: nn.Module,
    rows: torch.Tensor,
    positions: torch.Tensor,
    sign: float = 1.0,
    device: torch.device | None = None,
    kind: str | None = None,
) -> torch.Tensor:
    """``rows [n, heads, head_dim]`` (on the CPU) with row ``i`` turned by the model's rotary embedding at
    ``positions[i]`` (``sign`` -1: the turn undone), in the rows' dtype; ``device``: where the rotary module lives;
    ``kind``: the block's kind of attention (``config.layer_types``), for a rotary module that keeps one embedding per
    kind (Gemma-3: sliding and full attention, each with its own base; :func:`attention_kind`)."""
    shape = torch.zeros(1, len(positions), rows.shape[-1], device=device, dtype=torch.float32)
    with torch.no_grad():
        at = positions.to(device)[None]
        cos, sin = rotary(shape, at) if kind is None else rotary(shape, at, kind)
    cos, sin = cos[0].to(rows.dtype).cpu()[:, None], sin[0].to(rows.dtype).cpu()[:, None]  # [n, 1, head_dim]
    return rows * cos + sign * _rotate_half(rows) * sin


def attention_kind(rotary: nn.Module, config, block: int) -> str | None:
    """Block ``block``'s (1-based) kind of attention where ``rotary`` keeps an embedding per kind (its
    ``layer_types``: Gemma-3's sliding and full attention), else None (one embedding for every block)."""
    kinds, per_layer = getattr(rotary, "layer_types", None), getattr(config, "layer_types", None)
    if not kinds or not per_layer:
        return None
    return str(per_layer[block - 1])


def sliding_window(config, block: int) -> int | None:
    """Block ``block``'s (1-based) sliding window of attention (the positions a query sees), or None where it attends
    over every position: Mistral's ``sliding_window`` at every block, Gemma-2/3's at their ``sliding_attention``
    blocks. transformers' cache of such a block keeps only a prompt's last positions."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not isinstance(window, int) or window <= 0 or (kinds and kinds[block - 1] != "sliding_attention"):
        return None
    return window


@dataclass(frozen=True)
class KVBlock:
    """Block ``block``'s keys and values (see the module docstring)."""

    loaded: LoadedModel
    block: int  # 1..n_layers
    heads: int  # key/value heads
    head_dim: int

    @property
    def width(self) -> int:
        return 2 * self.heads * self.head_dim

    @property
    def layer(self) -> int:
        """The layer whose states the block reads."""
        return self.block - 1

    def _modules(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        module = self.loaded.probe.blocks[self.block - 1]
        return module.input_layernorm, module.self_attn.k_proj, module.self_attn.v_proj, module.self_attn

    def rows(self, states: torch.Tensor, position: int) -> torch.Tensor:
        """Cache rows ``[n, D]`` (float32) that layer-``block-1`` states ``[n, d]`` at ``position`` give."""
        return self.turned(self._unrotated(states), position)

    def _unrotated(self, states: torch.Tensor) -> torch.Tensor:
        norm, k_proj, v_proj, attention = self._modules()
        probe = self.loaded.probe
        with torch.no_grad():
            x = norm(states.to(device=probe.device, dtype=probe.dtype))
            keys = k_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
            k_norm = getattr(attention, "k_norm", None)  # Gemma3/Qwen3 normalise keys per head before the rotation
            if k_norm is not None:
                keys = k_norm(keys)
            return torch.cat([keys.flatten(-2), v_proj(x)], dim=-1).float().cpu()

    def _turn(self, rows: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        """Rows with each key rotated (``sign`` 1) or unrotated (-1) at its position ``positions`` ``[n]``."""
        probe = self.loaded.probe
        rotary = getattr(probe.base, "rotary_emb", None)
        if rotary is None:
            raise LminvertError(f"{self.loaded.name} has no rotary embedding where a Llama-style model keeps it")
        split = self.heads * self.head_dim
        keys = rows[:, :split].float().view(len(rows), self.heads, self.head_dim)
        kind = attention_kind(rotary, probe.config, self.block)
        keys = rotary_turn(rotary, keys, positions, sign, probe.device, kind)
        return torch.cat([keys.flatten(1), rows[:, split:].float()], dim=-1)

    def turned(self, rows: torch.Tensor, position: int, back: bool = False) -> torch.Tensor:
        """Rows ``[n, D]`` with every key rotated at ``position`` (``back``: the rotation at ``position`` undone);
        the rotation at position 0 is the identity, so a token's row at position 0 turned to ``position`` is its row
        there where nothing before it changes it (block 1), and back."""
        return self._turn(rows, torch.full((len(rows),), position), -1.0 if back else 1.0)

    def settled(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[T, D]`` of positions ``0 .. T - 1`` with every key's rotation undone (each as at position 0, where
        the rotation is the identity): what the block computes from each state before its position enters."""
        return self._turn(rows, torch.arange(len(rows)), -1.0)

    def moved(self, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """Rows ``[T, D]`` whose keys were rotated at positions ``offset .. offset + T - 1`` (a left-padded batch run
        with positions counted from its pads) with every key rotated at ``0 .. T - 1`` instead, as a forward of the
        prompt alone rotates them (values unchanged). The rotation is orthogonal: nothing else changes."""
        if offset == 0:
            return rows.float()
        positions = torch.arange(len(rows))
        return self._turn(self._turn(rows, positions + offset, -1.0), positions, 1.0)

    def cached(self, token_ids: list[int]) -> torch.Tensor:
        """The block's cache entries ``[T, D]`` (keys rotated) after a plain forward of ``token_ids``, as transformers
        stores them."""
        probe = self.loaded.probe
        cache = DynamicCache(config=probe.config)
        with torch.no_grad():
            probe.model(input_ids=torch.tensor([token_ids], device=probe.device), past_key_values=cache, use_cache=True)
        entry = cache.layers[self.block - 1]
        keys, values = entry.keys[0].float().cpu(), entry.values[0].float().cpu()  # [heads, T, head_dim]
        return torch.cat([keys.transpose(0, 1).flatten(1), values.transpose(0, 1).flatten(1)], dim=-1)

    @contextlib.contextmanager
    def replaced(self, rows: torch.Tensor) -> Iterator[None]:
        """Within: a forward of one sequence of ``len(rows)`` tokens caches ``rows`` ``[T, D]`` (as :meth:`cached`
        gives them) in the block, and attends with them."""
        _, k_proj, v_proj, attention = self._modules()
        split = self.heads * self.head_dim
        probe = self.loaded.probe
        rows = self._turn(rows, torch.arange(len(rows)), -1.0)  # the block rotates the keys it is given
        keys = rows[None, :, :split].to(device=probe.device, dtype=probe.dtype)
        values = rows[None, :, split:].to(device=probe.device, dtype=probe.dtype)
        if getattr(attention, "k_norm", None) is not None:
            raise LminvertError(
                f"{self.loaded.name} normalises keys after k_proj: replacing its cache is not supported"
            )
        handles = [
            k_proj.register_forward_hook(lambda module, args, output: keys),
            v_proj.register_forward_hook(lambda module, args, output: values),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def kv_block(loaded: LoadedModel, block: int) -> KVBlock:
    """Block ``block``'s cache view; a one-line error for a model whose attention is not Llama-style."""
    probe = loaded.probe
    if not 1 <= block <= probe.n_layers:
        raise LminvertError(f"a KV cache belongs to blocks 1..{probe.n_layers}; got block {block}")
    module = probe.blocks[block - 1]
    attention = getattr(module, "self_attn", None)
    if not all(hasattr(x, n) for x, n in ((module, "input_layernorm"), (attention, "k_proj"), (attention, "v_proj"))):
        raise LminvertError(
            f"{loaded.name}: KV leaks need Llama-style attention (input_layernorm, self_attn.k_proj/v_proj); "
            "use the states leak for this model"
        )
    config = probe.config
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return KVBlock(loaded, block, heads, head_dim)
