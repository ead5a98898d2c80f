"""Candidates' states kept across the rows searches of one leak and layer (:class:`StateMemo`): the defences of an
audit search the same prompts, so their searches verify many of the same candidates over the same recovered prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ...models import LoadedModel

MEMO_BYTES = 1 << 30  # states a StateMemo keeps, at most (the prefixes used longest ago are dropped first)


class _Kept:
    """What a memo keeps for one prefix: candidates' states (row ``index[token]``) and the model's prediction."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.states: torch.Tensor | None = None
        self.prediction: torch.Tensor | None = None

    @property
    def bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.states, self.prediction) if x is not None)


class StateMemo:
    """Candidates' states at one layer by (prefix, token), as the cached forward computed them, and the model's
    next-token prediction by prefix, kept for every search of one leak and layer: the defences of an audit search the
    same prompts, so their searches verify many of the same candidates over the same recovered prefixes. A state kept
    from another search's forward is as good as one computed again (the radii hold the cached forward's rounding
    whatever batch a candidate ran in); at most ``limit`` bytes are kept, the prefixes used longest ago dropped
    first."""

    def __init__(self, model: LoadedModel, layer, limit: int = MEMO_BYTES) -> None:
        self.probe, self.layer, self.limit = model.probe, layer, limit
        self._kept: OrderedDict[tuple[int, ...], _Kept] = OrderedDict()
        self.bytes = 0
        self.hits = self.computed = 0  # candidates served from the memo / run through the model

    def _entry(self, prefix_ids: list[int]) -> _Kept:
        key = tuple(prefix_ids)
        entry = self._kept.pop(key, None) or _Kept()
        self._kept[key] = entry  # the most recently used last
        return entry

    def _grown(self, entry: _Kept, before: int) -> None:
        self.bytes += entry.bytes - before
        while self.bytes > self.limit and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self.bytes -= dropped.bytes

    def states(
        self, prefix_ids: list[int], ids: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The states ``[n, d]`` of candidates ``ids`` after ``prefix_ids``; ``compute(missing)`` gives those of the
        candidates not kept (by the cached forward over the prefix)."""
        entry = self._entry(prefix_ids)
        wanted = ids.tolist()
        missing = list(dict.fromkeys(i for i in wanted if i not in entry.index))
        if missing:
            new = compute(torch.tensor(missing))
            before, start = entry.bytes, 0 if entry.states is None else len(entry.states)
            entry.index.update((token, start + k) for k, token in enumerate(missing))
            entry.states = new if entry.states is None else torch.cat([entry.states, new])
            self._grown(entry, before)
        self.hits += len(wanted) - len(missing)
        self.computed += len(missing)
        assert entry.states is not None
        return entry.states[torch.tensor([entry.index[i] for i in wanted], device=entry.states.device)]

    def kept(self, prefix_ids: list[int], ids: torch.Tensor) -> torch.Tensor:
        """Which of candidates ``ids`` after ``prefix_ids`` have their states kept ``[n]`` (bool)."""
        index = self._entry(prefix_ids).index
        return torch.tensor([i in index for i in ids.tolist()], dtype=torch.bool)

    def prediction(self, prefix_ids: list[int], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The model's prediction after ``prefix_ids`` (its log-probabilities of every token), ``compute()`` once."""
        entry = self._entry(prefix_ids)
        if entry.prediction is None:
            before = entry.bytes
            entry.prediction = compute()
            self._grown(entry, before)
        return entry.prediction

    def clear(self) -> None:
        """Drop everything kept (the counts stay)."""
        self._kept.clear()
        self.bytes = 0
