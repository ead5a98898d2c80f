"""The benchmarks' evaluation set for inversion: English prose, code, uniformly random token ids, personal data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lminvert.corpora import sample_prompts
from lminvert.models import LoadedModel

# Text with personal data, the case a leak matters for (invented; any resemblance is coincidental).
PERSONAL = "Patient: Maria Gonzalez, DOB 1984-03-12, SSN 078-05-1120, diagnosed with type 2 diabetes; call 555-0143."


@dataclass(frozen=True)
class EvalPrompt:
    kind: str  # prose | code | random | personal
    ids: tuple[int, ...]


def evaluation_prompts(model: LoadedModel, per_kind: int = 2, length: int = 20, seed: int = 0) -> list[EvalPrompt]:
    """``per_kind`` prompts of exactly ``length`` tokens each of prose, code and random ids (+1 personal)."""
    out: list[EvalPrompt] = []
    for kind in ("prose", "code"):
        prompts, _ = sample_prompts(model.tokenizer, kind, per_kind, max_tokens=length, seed=seed, min_tokens=length)
        out += [EvalPrompt(kind, p.ids[:length]) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(per_kind):
        ids = torch.randint(0, model.probe.vocab_size, (length,), generator=gen)
        out.append(EvalPrompt("random", tuple(int(x) for x in ids)))
    out.append(EvalPrompt("personal", tuple(model.tokenize(PERSONAL, length))))
    return out
