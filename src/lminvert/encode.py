"""Prompts -> hidden states at one layer (the forward direction), and the checks that pair states with a model."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from . import __version__
from .errors import LminvertError
from .models import LoadedModel
from .states import HiddenStates

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def token_ids_of(model: LoadedModel, prompts: Sequence[Prompt], max_tokens: int | None = None) -> list[list[int]]:
    """Tokenise text prompts (ids pass through), truncated to ``max_tokens``."""
    if not prompts:
        raise LminvertError("no prompts given: pass at least one text or token-id list")
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = model.tokenize(prompt, max_tokens)
        else:
            ids = [int(t) for t in prompt][:max_tokens]
            if not ids:
                raise LminvertError("empty token-id list: every prompt needs at least one token")
        out.append(ids)
    return out


def padded_batch(ids: Sequence[Sequence[int]], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-padded ``[len(rows), width]`` ids of ``ids[rows]`` and their attention mask (None if no padding)."""
    width = max(len(ids[i]) for i in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, i in enumerate(rows):
        batch[row, : len(ids[i])] = torch.tensor(ids[i])
        mask[row, : len(ids[i])] = 1
    return batch, (mask if bool((mask == 0).any()) else None)


def batched_states(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    layers: Sequence[int | str],
    batch_tokens: int = 8192,
    progress: bool = True,
) -> list[dict[int, torch.Tensor]]:
    """Per-prompt states ``{layer: [T_i, d]}`` from batched, right-padded full forwards (sorted by length)."""
    probe = model.probe
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: list[dict[int, torch.Tensor]] = [{} for _ in ids]
    bar = tqdm(total=len(ids), desc="encoding", unit="prompt", disable=not progress, leave=False)
    start = 0
    while start < len(order):
        longest = len(ids[order[start]])
        stop = start
        while stop < len(order) and (stop - start + 1) * max(longest, len(ids[order[stop]])) <= batch_tokens:
            longest = max(longest, len(ids[order[stop]]))
            stop += 1
        stop = max(stop, start + 1)
        chunk = order[start:stop]
        batch, mask = padded_batch(ids, chunk)
        out = probe.states(batch, layers, attention_mask=mask)
        for row, i in enumerate(chunk):
            results[i] = {layer: state[row, : len(ids[i])].float().cpu() for layer, state in out.items()}
        bar.update(len(chunk))
        start = stop
    bar.close()
    return results


def encode(
    model: LoadedModel,
    prompts: Sequence[Prompt],
    layer: int | str,
    max_tokens: int | None = None,
    keep_ids: bool = False,
    progress: bool = False,
) -> HiddenStates:
    """Layer-``layer`` states of every position of each prompt (text or token ids)."""
    resolved = model.probe.resolve_layer(layer)
    ids = token_ids_of(model, prompts, max_tokens)
    per_prompt = batched_states(model, ids, [resolved], progress=progress)
    return HiddenStates(
        states=tuple(p[resolved] for p in per_prompt),
        model=model.name,
        weights_hash=model.weights_hash,
        layer=model.probe.layer_name(resolved),
        n_layers=model.probe.n_layers,
        dtype=model.dtype,
        token_ids=tuple(tuple(x) for x in ids) if keep_ids else None,
        lminvert_version=__version__,
    )


def check_compatible(states: HiddenStates, model: LoadedModel, layer: int | str | None) -> int:
    """Check that ``states`` can come from ``model``; return the resolved layer (from the file if not given)."""
    probe = model.probe
    if states.weights_hash and states.weights_hash != model.weights_hash:
        raise LminvertError(
            f"these states were made by a model with weights hash {states.weights_hash} ('{states.model}'), "
            f"not by '{model.name}' ({model.weights_hash}); pass the model that produced them with --model"
        )
    if states.hidden_size != probe.hidden_size:
        raise LminvertError(
            f"states have hidden size {states.hidden_size} but '{model.name}' has {probe.hidden_size}; "
            "pass the model that produced them with --model"
        )
    if layer is None:
        layer = states.layer
    if layer is None:
        raise LminvertError("the states file does not say which layer it holds: pass --layer")
    resolved = probe.resolve_layer(layer)
    if states.layer is not None and probe.resolve_layer(states.layer) != resolved:
        raise LminvertError(f"the states file holds layer {states.layer}, not {layer}; drop --layer or fix it")
    return resolved
