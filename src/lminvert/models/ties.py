"""Tokens the model cannot tell apart: vocabulary entries whose input vectors are bit-for-bit identical.

Two prompts that differ only in such tokens give the same input to the first block, hence mathematically identical
states at every layer: a collision by construction (the paper's "tied parameters" exception, not a
counterexample to injectivity for generic weights). SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) has 15 such
tokens in 4 groups (11 unused special tokens such as ``<issue_start>`` and ``<jupyter_code>``, and 4 rare ordinary
ones). The collision search and the exhaustive test find them, and report them apart from the pairs whose inputs
differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .loading import LoadedModel


def tied_token_groups(model: LoadedModel) -> list[list[int]]:
    """Groups (sorted, size >= 2) of token ids whose input vectors ``probe.vocab_matrix()`` rows are identical."""
    with torch.no_grad():
        matrix = model.probe.vocab_matrix().detach().float().cpu()
    _, inverse, counts = torch.unique(matrix, dim=0, return_inverse=True, return_counts=True)
    tied = (counts > 1).nonzero().flatten()
    if tied.numel() == 0:
        return []
    groups: dict[int, list[int]] = {int(g): [] for g in tied}
    for token in torch.isin(inverse, tied).nonzero().flatten().tolist():
        groups[int(inverse[token])].append(token)
    return sorted(sorted(g) for g in groups.values())


def representatives(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Token -> the smallest id of its tied group (only tokens in a group appear)."""
    return {token: min(group) for group in groups for token in group}


def same_input(a: Sequence[int], b: Sequence[int], rep: dict[int, int]) -> bool:
    """Whether two token sequences feed the model identical input vectors (equal after mapping tied tokens)."""
    return len(a) == len(b) and all(rep.get(x, x) == rep.get(y, y) for x, y in zip(a, b, strict=True))


def tied_pairs(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Every pair ``(a, b)``, ``a < b``, of tokens in the same group."""
    return [(a, b) for group in groups for i, a in enumerate(group) for b in group[i + 1 :]]
