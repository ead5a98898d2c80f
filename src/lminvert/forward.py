"""The forward direction, batched: prompts -> hidden states, through the layer probe only.

One batcher (:func:`length_batches`: prompts sorted by length, at most ``batch_tokens`` padded tokens per
forward; for every position's states, only prompts of one length together) serves every shape of output:

* :func:`prompt_states` - every position of each prompt (what :func:`encode` writes to a states file);
* :func:`last_token_states` - each prompt's last position (what the collision search compares);
* :func:`vocabulary_states` - ``prefix + [v]`` for every vocabulary token ``v``, over one KV cache (the
  exhaustive test and the first-position table of inversion).

States come back as float32 on the CPU whatever the model's dtype and device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ._version import __version__
from .errors import LminvertError
from .models import LoadedModel
from .models.layers import Layer, LayerSpec
from .models.loading import require_loaded, token_id_list
from .models.single_key import single_key
from .states import HiddenStates

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def token_ids_of(model: LoadedModel, prompts: Sequence[Prompt], max_tokens: int | None = None) -> list[list[int]]:
    """Tokenise text prompts (ids pass through), truncated to ``max_tokens``. One text, or one prompt's ids (a flat
    list or a 1-d tensor), is one prompt (a text was read as one prompt per character)."""
    if max_tokens is not None and max_tokens < 1:
        raise LminvertError(f"max_tokens must be at least 1, got {max_tokens}")
    if isinstance(prompts, torch.Tensor | np.ndarray):
        prompts = prompts.tolist()
    elif prompts is not None and not isinstance(prompts, Sequence):  # a generator of prompts, say
        try:
            prompts = list(prompts)
        except TypeError:
            raise LminvertError(f"prompts are a list of texts or of token-id lists, not {prompts!r:.60}") from None
    if isinstance(prompts, str) or (prompts and token_id_list(prompts) is not None):
        prompts = [prompts]  # type: ignore[list-item]
    if prompts is None or not len(prompts):
        raise LminvertError("no prompts given: pass at least one text or token-id list")
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = model.tokenize(prompt, max_tokens)
        else:
            listed = token_id_list(prompt)
            if listed is None:
                raise LminvertError(f"a prompt is a text or a list of token ids, not {prompt!r:.60}")
            ids = listed[:max_tokens]
            if not ids:
                raise LminvertError("empty token-id list: every prompt needs at least one token")
        out.append(ids)
    return out


def length_batches(ids: Sequence[Sequence[int]], batch_tokens: int, same_length: bool = False) -> list[list[int]]:
    """Indices of ``ids`` sorted by length (then index), split into batches of at most ``batch_tokens`` padded
    tokens (a prompt longer than that gets a batch of its own); ``same_length``: only prompts of one length share a
    batch (nothing padded); ``batch_tokens=0``: one prompt per batch."""
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # sorted by length: the newest prompt is the widest of its batch
        new_length = same_length and bool(current) and len(ids[current[-1]]) != len(ids[i])
        if current and (new_length or len(ids[i]) * (len(current) + 1) > batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_batch(
    ids: Sequence[Sequence[int]], rows: Sequence[int], side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[len(rows), width]`` ids of ``ids[rows]`` padded on ``side`` (pad id 0) and their attention mask (None if no
    padding)."""
    width = max(len(ids[i]) for i in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, i in enumerate(rows):
        where = slice(0, len(ids[i])) if side == "right" else slice(width - len(ids[i]), width)
        batch[row, where] = torch.tensor(ids[i])
        mask[row, where] = 1
    return batch, (mask if bool((mask == 0).any()) else None)


def padded_positions(batch: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's positions counted from its first real token, as transformers' ``generate`` counts them (a left-padded
    row's first token is position 0: a model with learned absolute positions would otherwise compute something else)."""
    if mask is None:
        return torch.arange(batch.shape[1])[None].expand_as(batch)
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def _batched(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    layers: Sequence[Layer],
    batch_tokens: int,
    progress: bool,
    same_length: bool = False,
) -> Iterator[tuple[list[int], dict[Layer, torch.Tensor]]]:
    bar = tqdm(total=len(ids), desc="encoding", unit="prompt", disable=None if progress else True, leave=False)
    try:
        for rows in length_batches(ids, batch_tokens, same_length):
            batch, mask = padded_batch(ids, rows)
            yield rows, model.probe.states(batch, layers, attention_mask=mask)
            bar.update(len(rows))
    finally:
        bar.close()


def prompt_states(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    layers: Sequence[LayerSpec],
    batch_tokens: int = 8192,
    progress: bool = True,
) -> list[dict[Layer, torch.Tensor]]:
    """Per prompt, ``{layer: [T_i, d]}`` float32 states of every position.

    Only prompts of one length run together (never padded: a padded batch rounds differently in half precision,
    SmolLM2, bfloat16, layer 6: up to 6e-4 of the norm). ``batch_tokens=0``: one prompt per forward, so that each
    prompt's states are exactly what it gives alone, which the inversion's recomputation (one sequence of the same
    length per forward) reproduces bit for bit; several sequences in one forward can differ in the last bits
    (float32, two threads, on this project's CPU). :func:`encode` does that."""
    resolved = model.probe.layers(layers)
    results: list[dict[Layer, torch.Tensor]] = [{} for _ in ids]
    for rows, out in _batched(model, ids, resolved, batch_tokens, progress, same_length=True):
        for row, i in enumerate(rows):
            results[i] = {layer: state[row, : len(ids[i])].float().cpu() for layer, state in out.items()}
    return results


def last_token_states(
    model: LoadedModel,
    ids: Sequence[Sequence[int]],
    layers: Sequence[LayerSpec],
    batch_tokens: int = 4096,
    progress: bool = False,
) -> dict[Layer, np.ndarray]:
    """``{layer: [len(ids), d]}`` float32 states of each prompt's last token."""
    resolved = model.probe.layers(layers)
    out = {layer: np.empty((len(ids), model.probe.hidden_size), dtype=np.float32) for layer in resolved}
    for rows, states in _batched(model, ids, resolved, batch_tokens, progress):
        last = torch.tensor([len(ids[i]) - 1 for i in rows], device=model.device)
        index = torch.arange(len(rows), device=model.device)
        for layer in resolved:
            out[layer][rows] = states[layer][index, last].float().cpu().numpy()
    return out


def vocabulary_states(
    model: LoadedModel,
    prefix_ids: Sequence[int],
    layers: Sequence[LayerSpec],
    tokens: torch.Tensor | None = None,
    batch: int = 1024,
    progress: bool = False,
    desc: str = "vocabulary",
) -> Iterator[tuple[torch.Tensor, dict[Layer, torch.Tensor]]]:
    """States of ``prefix + [v]`` for each token ``v`` of ``tokens`` (default: the whole vocabulary).

    The prefix's KV cache is built once (blocks up to the highest layer); the continuations run ``batch`` at a
    time over it. Yields ``(token ids, {layer: [b, d] float32 CPU states})`` per batch.
    """
    probe = model.probe
    resolved = probe.layers(layers)
    prefix = probe.prefix(list(prefix_ids), max(resolved))
    tokens = torch.arange(probe.vocab_size) if tokens is None else tokens
    bar = tqdm(
        total=len(tokens), desc=desc, unit="token", unit_scale=True, disable=None if progress else True, leave=False
    )
    try:
        with torch.no_grad():
            for chunk in tokens.split(batch):
                # tokens alone attend to their own key only: no query or key products (:mod:`.models.single_key`)
                with single_key(probe.blocks) if not prefix_ids else contextlib.nullcontext():
                    states = probe.continuation(prefix, token_ids=chunk, layers=resolved)
                assert isinstance(states, dict)
                yield chunk, {layer: s.float().cpu() for layer, s in states.items()}
                bar.update(len(chunk))
    finally:
        bar.close()


def encode(
    model: LoadedModel,
    prompts: Sequence[Prompt],
    layer: LayerSpec,
    max_tokens: int | None = None,
    keep_ids: bool = False,
    progress: bool = False,
) -> HiddenStates:
    """Layer-``layer`` states of every position of each prompt (text or token ids)."""
    model = require_loaded(model, "encode")
    resolved = model.probe.layer(layer)
    ids = token_ids_of(model, prompts, max_tokens)
    per_prompt = prompt_states(model, ids, [resolved], batch_tokens=0, progress=progress)  # each prompt alone
    return HiddenStates(
        states=tuple(p[resolved] for p in per_prompt),
        model=model.name,
        weights_hash=model.weights_hash,
        layer=resolved.name,
        n_layers=model.probe.n_layers,
        dtype=model.dtype,
        token_ids=tuple(tuple(x) for x in ids) if keep_ids else None,
        lminvert_version=__version__,
    )
