"""Forwards of tokens alone at position 0 without their attention's query and key products (:func:`single_key`).

A token alone (an empty prefix: a first-position table's forward) attends to one key, its own: softmax over one
finite score is exactly 1, so the attention's output is the token's value vector, bit for bit, whatever its query and
key. Within :func:`single_key` each block's separate query and key projections (``q_proj``/``k_proj``: Llama,
Mistral, Qwen, Gemma, OPT) return zeros instead of their products, which leaves such forwards' states unchanged bit for
bit (``tests/unit/test_probe.py``) and skips a part of every block's products: SmolLM2 442k of 3.5M multiply-adds a
token (a first-position table in 0.88x the time, docs/results.md). Fused projections (GPT-2's ``c_attn``, Pythia's
``query_key_value``) are left as they are.

Only for forwards in which every token is alone: a token with a prefix would attend by scores of zero, uniformly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PROJECTIONS = ("q_proj", "k_proj")  # the attention modules' query and key projections, where separate
SINGLE_KEY = True  # a first-position table's forward skips them (False: every product runs)


class _Zeros(torch.nn.Module):
    """What a projection to ``width`` numbers gives within :func:`single_key`: zeros of its input's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.width)


@contextlib.contextmanager
def single_key(blocks: torch.nn.ModuleList) -> Iterator[None]:
    """Within: the query and key projections of every block of ``blocks`` give zeros (where they are separate
    ``torch.nn.Linear`` modules, and :data:`SINGLE_KEY` is on); restored on exit."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    if SINGLE_KEY:
        for block in blocks:
            attention = getattr(block, "self_attn", None)
            for name in PROJECTIONS:
                linear = getattr(attention, name, None)
                if isinstance(linear, torch.nn.Linear):
                    swapped.append((attention, name, linear))
    try:
        for attention, name, linear in swapped:
            setattr(attention, name, _Zeros(linear.out_features))
        yield
    finally:
        for attention, name, linear in swapped:
            setattr(attention, name, linear)
