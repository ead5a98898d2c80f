"""The evaluation prompts the experiments and benchmarks share: English prose, code, uniformly random token ids,
chat-formatted text (the model's chat template around a prose message) and one text with personal data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..corpora import sample_prompts
from ..errors import LminvertError
from ..models import LoadedModel

# Text with personal data, the case a leak matters for (invented; any resemblance is coincidental).
PERSONAL = "Patient: Maria Gonzalez, DOB 1984-03-12, SSN 078-05-1120, diagnosed with type 2 diabetes; call 555-0143."
KINDS = ("prose", "code", "random", "chat", "personal")
DEFAULT_KINDS = ("prose", "code", "random", "personal")


@dataclass(frozen=True)
class EvalPrompt:
    kind: str  # one of KINDS
    ids: tuple[int, ...]


def _chat(model: LoadedModel, n: int, length: int, seed: int) -> list[EvalPrompt]:
    """The last ``length`` tokens of a chat turn (system + user message + assistant header) per prose message."""
    messages, _ = sample_prompts(model.tokenizer, "prose", n, max_tokens=2 * length, seed=seed + 7, min_tokens=length)
    out = []
    for m in messages:
        text = model.tokenizer.decode(list(m.ids), skip_special_tokens=True)
        turn = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
        if getattr(model.tokenizer, "chat_template", None):
            ids = model.tokenizer.apply_chat_template(turn, tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = model.tokenize(f"<|user|>\n{text}\n<|assistant|>\n")
        out.append(EvalPrompt("chat", tuple(int(t) for t in ids[-length:])))
    return out


def evaluation_prompts(
    model: LoadedModel,
    per_kind: int = 2,
    length: int = 20,
    seed: int = 0,
    kinds: Sequence[str] = DEFAULT_KINDS,
) -> list[EvalPrompt]:
    """``per_kind`` prompts of exactly ``length`` tokens of each kind (one ``personal``), in the order of ``kinds``.

    Text kinds need the model's tokenizer and ids below its vocabulary size; ``random`` works for any model.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise LminvertError(f"unknown prompt kind(s) {', '.join(unknown)}: use {', '.join(KINDS)}")
    out: list[EvalPrompt] = []
    for kind in kinds:
        if kind in ("prose", "code"):
            prompts, _ = sample_prompts(
                model.tokenizer, kind, per_kind, max_tokens=length, seed=seed, min_tokens=length
            )
            out += [EvalPrompt(kind, p.ids[:length]) for p in prompts]
        elif kind == "random":
            gen = torch.Generator().manual_seed(seed)
            for _ in range(per_kind):
                ids = torch.randint(0, model.probe.vocab_size, (length,), generator=gen)
                out.append(EvalPrompt("random", tuple(int(x) for x in ids)))
        elif kind == "chat":
            out += _chat(model, per_kind, length, seed)
        else:
            out.append(EvalPrompt("personal", tuple(model.tokenize(PERSONAL, length))))
    return out
