"""Every place lminvert reaches into transformers beyond the model classes' public API, in one module, so that a
transformers upgrade touches one file: the attention implementation a config selects (a private attribute), the
registries of attention functions and mask builders, the sdpa kernel the observer's forward wraps, and the cache
classes the probe's prefix caches build on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

__all__ = [
    "Cache",
    "CacheLayerMixin",
    "attn_implementation",
    "register_attention",
    "sdpa_attention_forward",
    "using_attention",
]


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model's config selects (``eager``, ``sdpa``, ...), or None where it says none."""
    return getattr(config, "_attn_implementation", None)


@contextlib.contextmanager
def using_attention(configs: Sequence[Any], name: str) -> Iterator[None]:
    """Within: every config in ``configs`` selects the attention implementation ``name`` (restored after)."""
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, value in zip(configs, before, strict=True):
            config._attn_implementation = value


def register_attention(name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> None:
    """Make ``name`` an attention implementation transformers' models can select: ``attention`` computes it,
    ``mask`` builds (or declines, returning None) its attention mask."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
