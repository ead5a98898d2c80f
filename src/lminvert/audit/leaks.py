"""What an attacker holds is a view of the deployment's computation (:mod:`lminvert.invert.views`: ``states``, ``kv``,
``last``); the audit adds what the deployment's output becomes when it computes with defended rows
(:func:`outputs`: next-token logits, the utility a defence costs)."""

from __future__ import annotations

import contextlib

import torch

from ..invert.views import VIEWS, KVView, LastView, View, make_view

LEAKS = VIEWS
Leak = View
make_leak = make_view


def outputs(leak: View, token_ids: list[int], kept: torch.Tensor | None) -> torch.Tensor:
    """Next-token logits of the deployment computing with ``kept`` rows (None: as computed): ``[T, V]``, the last
    position's alone ``[1, V]`` for a ``last`` leak."""
    if isinstance(leak, LastView):
        if kept is None:
            return _logits(leak, token_ids, None)[-1:]
        states = VIEWS["states"](leak.model, leak.layer).capture(token_ids)
        states[-1:] = kept
        return _logits(leak, token_ids, states)[-1:]
    if isinstance(leak, KVView):
        with contextlib.nullcontext() if kept is None else leak.block.replaced(kept):
            return _logits(leak, token_ids, None)
    return _logits(leak, token_ids, kept)


def _logits(leak: View, token_ids: list[int], states: torch.Tensor | None) -> torch.Tensor:
    """Next-token logits ``[T, V]`` of a plain forward (``states``: the layer's states replaced by these)."""
    probe = leak.model.probe
    ids = torch.tensor([token_ids], device=probe.device)
    with torch.no_grad():
        if states is None:
            return leak.model.model(input_ids=ids).logits[0].float().cpu()
        final = probe.final_from(states, leak.layer)
        return probe.next_token_logits(final[0], normed=True).float().cpu()
