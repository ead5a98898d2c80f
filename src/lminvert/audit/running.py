"""The recovered prefix of one rows search, with its caches grown a token at a time (:class:`Running`): the model's
own KV cache over every block (its next-token prediction after the prefix) and the layer probe's prefix at the
searched layer (the candidates' cached forward). Without it each position recomputes both over the whole prefix.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..models import LoadedModel, Prefix


class Running:
    """The prefix recovered so far (:attr:`ids`) and, made where first asked and then grown by the tokens added since,
    the model's prediction after it (every token, most likely first) and the probe's prefix at ``layer``. Each cache
    holds the KV cache of one prompt only: a prefix that is not :attr:`ids` is computed elsewhere."""

    def __init__(self, model: LoadedModel, layer) -> None:
        self.model, self.layer = model, layer
        self.ids: list[int] = []
        self._cache: DynamicCache | None = None  # the model's, over ids[: self._cached]
        self._cached = 0
        self._order: torch.Tensor | None = None  # the prediction after ids[: self._cached]
        self._prefix: Prefix | None = None  # the probe's, over ids[: self._prefix.length]

    def add(self, token: int) -> None:
        """The next position's token (no forward runs until a cache is asked for)."""
        self.ids.append(int(token))

    def holds(self, prefix_ids: list[int]) -> bool:
        """Whether ``prefix_ids`` is the running prefix (and not empty: an empty prefix has no caches)."""
        return bool(prefix_ids) and prefix_ids == self.ids

    def prediction(self) -> torch.Tensor:
        """Every token, most likely next after :attr:`ids` first (the tokens added since the last call run through
        every block in one forward over the model's cache)."""
        if self._order is None or self._cached < len(self.ids):
            probe = self.model.probe
            if self._cache is None:
                self._cache = DynamicCache(config=probe.config)
            new = torch.tensor([self.ids[self._cached :]], device=probe.device)
            with torch.no_grad():
                out = self.model.model(input_ids=new, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
            self._cached = len(self.ids)
            self._order = out.logits[0, -1].float().cpu().argsort(descending=True)
        return self._order

    def prefix(self) -> Prefix:
        """The probe's prefix of :attr:`ids` at the layer (grown by the tokens added since the last call, one forward
        each; made in one forward the first time)."""
        probe = self.model.probe
        if self._prefix is None:
            self._prefix = probe.prefix(self.ids, self.layer)
        for token in self.ids[self._prefix.length :]:
            self._prefix = probe.extend(self._prefix, token)
        return self._prefix
