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

from .derived import derived
from .loading import LoadedModel

HASHED = 64  # entries of each row that go into its bucket's hash (whole rows decide the groups)


def tied_token_groups(model: LoadedModel) -> list[list[int]]:
    """Groups (sorted, size >= 2) of token ids whose input vectors ``probe.vocab_matrix()`` rows are identical.

    Rows are first bucketed by an exact integer hash of the bits of ``HASHED`` of their entries (a wrapping sum of
    the float32 bit patterns times random 64-bit weights: identical rows hash alike), then every bucket of two or
    more is split by exact comparison of whole rows, so a shared hash never ties two different rows. Much faster
    than sorting the whole matrix (``torch.unique(dim=0)``). Every inversion asks for them: they are kept in the
    model's memo while the vocabulary matrix is the same tensor, unedited (Gemma-3-270m's 262,144 rows took 0.16 s
    per call here)."""
    kept = model.probe.vocab_matrix()
    with torch.no_grad():
        groups = derived(model.memo, "tied-groups", kept, lambda: _groups(kept.detach()))
    return [list(group) for group in groups]


def tied_twins(model: LoadedModel) -> dict[int, tuple[int, ...]]:
    """Each tied token's twins (the other members of its :func:`tied_token_groups` group); tokens with none are
    absent."""
    return {t: tuple(x for x in g if x != t) for g in tied_token_groups(model) for t in g}


def _groups(matrix: torch.Tensor) -> list[list[int]]:
    """:func:`tied_token_groups` of ``matrix``'s rows, computed."""
    columns = torch.linspace(0, matrix.shape[1] - 1, min(HASHED, matrix.shape[1])).long().unique()
    sample = matrix[:, columns.to(matrix.device)].float().cpu() + 0.0  # -0.0 -> 0.0: equal as inputs
    bits = sample.contiguous().view(torch.int32).to(torch.int64)
    weights = torch.randint(-(2**62), 2**62, (len(columns),), generator=torch.Generator().manual_seed(0))
    keys = (bits * weights).sum(dim=1)  # int64 arithmetic wraps: exact and order-independent
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    groups: list[list[int]] = []
    for bucket in (counts > 1).nonzero().flatten().tolist():
        rest = (inverse == bucket).nonzero().flatten().tolist()
        rows = {t: matrix[t].float().cpu() + 0.0 for t in rest}
        while len(rest) > 1:  # split the bucket into groups of exactly equal rows
            same = [t for t in rest if torch.equal(rows[t], rows[rest[0]])]
            if len(same) > 1:
                groups.append(sorted(same))
            rest = [t for t in rest if t not in same]
    return sorted(groups)


def representatives(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Token -> the smallest id of its tied group (only tokens in a group appear)."""
    return {token: min(group) for group in groups for token in group}


def same_input(a: Sequence[int], b: Sequence[int], rep: dict[int, int]) -> bool:
    """Whether two token sequences feed the model identical input vectors (equal after mapping tied tokens)."""
    return len(a) == len(b) and all(rep.get(x, x) == rep.get(y, y) for x, y in zip(a, b, strict=True))


def tied_pairs(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Every pair ``(a, b)``, ``a < b``, of tokens in the same group."""
    return [(a, b) for group in groups for i, a in enumerate(group) for b in group[i + 1 :]]
