"""The model's next-token prior over whole prefixes from a document boundary: what proposes prefixes to one vector's
search for whole prompts (:mod:`.last`). A proposal, never evidence."""

from __future__ import annotations

import math

import torch

from ..models import LoadedModel
from ..paths import past

BATCH = 64  # prefixes per forward (a deep layer's search checks its deadline between them)


class Prior:
    """The model's next-token prior over prefixes: log-probabilities of every token after each prefix, from a
    document boundary (the tokenizer's end-of-text token; a proposal, never evidence)."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        tokenizer = model.tokenizer
        start = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.start = [int(start)] if start is not None else []

    def logprobs(self, prefixes: list[tuple[int, ...]], deadline: float | None = None) -> torch.Tensor:
        """``[n, V]`` log-probabilities of the next token after each prefix (all of one length), in batches of
        ``BATCH``: with a ``deadline`` (:func:`lminvert.paths.clock`), those of the first ``n`` prefixes scored before
        it passed (at least one batch)."""
        rows = [[*self.start, *p] for p in prefixes]
        if not rows[0]:
            vocab = self.model.probe.vocab_size
            return torch.full((len(rows), vocab), -math.log(vocab))
        out = []
        with torch.no_grad():
            for first in range(0, len(rows), BATCH):
                if out and past(deadline):
                    break
                ids = torch.tensor(rows[first : first + BATCH], device=self.model.probe.device)
                logits = self.model.model(input_ids=ids, logits_to_keep=1).logits[:, -1]
                out.append(logits.float().log_softmax(-1).cpu())
        return torch.cat(out)
