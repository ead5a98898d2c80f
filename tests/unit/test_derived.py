"""A value derived from a tensor is kept while the tensor is the same object, unedited, and computed again after."""

from __future__ import annotations

import torch

from lminvert.models.derived import derived


def test_kept_until_the_tensor_is_edited_or_replaced():
    store: dict = {}
    calls = []

    def norms_of(t: torch.Tensor):
        def compute() -> torch.Tensor:
            calls.append(1)
            return t.norm(dim=1)

        return derived(store, "norms", t, compute)

    matrix = torch.ones(3, 4)
    first = norms_of(matrix)
    assert norms_of(matrix) is first and len(calls) == 1  # the same tensor, unedited: kept
    matrix[0, 0] = 5.0  # edited in place
    assert norms_of(matrix)[0] > first[0] and len(calls) == 2
    other = matrix.clone()  # equal values, another tensor
    norms_of(other)
    assert len(calls) == 3 and len(store) == 1  # one entry per key, the stale one replaced
