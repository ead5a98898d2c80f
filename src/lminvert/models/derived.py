"""Values derived from a tensor that may be edited in place, kept until it is."""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def derived(store: MutableMapping[Hashable, Any], key: Hashable, tensor: torch.Tensor, compute: Callable[[], T]) -> T:
    """``compute()``, kept in ``store[key]`` with ``tensor`` itself and its version counter, and returned again while
    ``tensor`` is the same object, unedited; once it is another tensor or was edited in place, computed again and the
    entry replaced. One entry per key holding the tensor: an id alone could be reused by a new tensor, and a key per
    version would keep every stale value."""
    entry = store.get(key)
    if entry is None or entry[0] is not tensor or entry[1] != tensor._version:
        entry = (tensor, tensor._version, compute())
        store[key] = entry
    return entry[2]
