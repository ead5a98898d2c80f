"""The model's next-token prediction for one rows search (:class:`Prediction`), the first of its rankers: after the
recovered prefix, from the running cache's blocks above the layer (:class:`.running.Running`) or one forward of the
prefix; or, for a KV cache whose rows give it (:meth:`.rankers.StateReading.predicts`), from the rows read back, once
per prompt, so that no block above the layer runs while the prefix grows. A proposal only: every candidate it ranks is
verified, so a poor prediction costs time, never an answer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ...models import LoadedModel
from ..proposal import ranked
from .memo import StateMemo
from .rankers import StateReading
from .running import Running, predicted


class Prediction:
    """One search's predictions (``reading``: the rows' reading, where there is one; ``memo``: where a prefix's
    prediction is kept for the searches of other defences; ``reuse``: as :class:`.running.Running` takes it)."""

    def __init__(
        self, model: LoadedModel, layer, reading: StateReading | None, memo: StateMemo | None, reuse: bool
    ) -> None:
        self.model, self.layer, self.reading, self.memo, self.reuse = model, layer, reading, memo, reuse
        self._rows = torch.empty(0)  # the prompt being searched
        self._priors: list[torch.Tensor | None] | None = None  # the prediction its rows give, once asked for

    def start(self, shipped: torch.Tensor, known: Sequence[int] = ()) -> Running:
        """A prompt's recovered prefix (:class:`.running.Running`, holding ``known``, its first tokens, else empty);
        where its rows ``shipped`` give the prediction (:meth:`.rankers.StateReading.predicts`), one that runs no block
        above the layer."""
        self._rows, self._priors = shipped, None
        rows = self.reading is not None and self.reading.predicts(shipped)
        running = Running(self.model, self.layer, self.reuse, predicts=not rows)
        for token in known:
            running.add(token)
        return running

    def log_probs(self, prefix: list[int], running: Running | None = None) -> torch.Tensor:
        """The model's log-probabilities of every next token after ``prefix`` ``[V]`` (float32, CPU): the rows' own
        where ``running`` holds the prefix and does not predict (:meth:`.rankers.StateReading.priors`, made when first
        asked for after position 0); else from ``running``'s cache where it holds the prefix, or one forward of it,
        kept in the memo."""
        if running is not None and running.holds(prefix) and not running.predicts:
            if self._priors is None:
                assert self.reading is not None
                self._priors = self.reading.priors(self._rows, prefix[0])
            found = self._priors[len(prefix)]
            assert found is not None
            return found
        if running is not None and running.holds(prefix):
            compute = running.log_probs
        else:
            compute = functools.partial(predicted, self.model, prefix)
        return compute() if self.memo is None else self.memo.prediction(prefix, compute)

    def ranked(self, prefix: list[int], running: Running | None = None, top: int | None = None) -> torch.Tensor:
        """Every token, most likely next first (:meth:`log_probs`; ``top``: the first ``top`` only)."""
        return ranked(self.log_probs(prefix, running), descending=True, top=top)
