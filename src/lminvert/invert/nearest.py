"""The nearest other token at one position, found by verifying the whole vocabulary: what the calibration's ``gap``
(:mod:`.tolerance`, measured to a sample of candidates) stands for, and how far from it it lies.

The acceptor's rules for an exact source take a fraction of that gap (:data:`.acceptor.TOKEN_GAP_SAFETY`), because a
sample of candidates misses a position's nearest token: ``benchmarks/bench_gap.py`` measures the ratio with
:func:`nearest_others` on real models, and the tests on the tiny ones. A measurement, not part of any search: the
vocabulary's states over the prefix's cache (:func:`lminvert.forward.vocabulary_states`, ``chunk`` tokens a forward,
every layer asked at once), as many forwards as a brute force.

:func:`near_inputs` gives the calibrations their hardest candidates: near the first layers a position's nearest token
is one whose input vector points nearly where the true token's does (SmolLM2 bfloat16, 8 positions of 4 held-out
prompts: at layer 1 the nearest state's token was among the true token's 4 nearest input vectors by angle every time,
at layer 15 in 5 of 8; at layer 30 in none, docs/results.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..forward import vocabulary_states
from ..models import Layer, LoadedModel
from ..models.derived import derived
from ..models.ties import tied_twins


@dataclass(frozen=True)
class Nearest:
    """At one position and layer: the nearest other token's state, relative to the true state's norm."""

    distance: float  # ||other - h|| / ||h||, h the plain forward's state of the prompt cut after the position
    token: int  # the other token
    own: float  # the true token's cached state's relative disagreement with h (the verification's rounding)


def nearest_others(
    model: LoadedModel, prompt: list[int], t: int, layers: list[Layer], chunk: int = 2048
) -> dict[Layer, Nearest]:
    """Per layer of ``layers``: the token, other than ``prompt[t]``, whose state at position ``t`` (after
    ``prompt[:t]``) lies nearest the true one's, over every entry of the vocabulary."""
    if not 0 <= t < len(prompt):
        raise ValueError(f"position {t} is outside the prompt's {len(prompt)} tokens")
    plain = model.probe.states(torch.tensor([prompt[: t + 1]]), layers)
    truth = {layer: plain[layer][0, t].double().cpu() for layer in layers}
    best = {layer: (float("inf"), -1) for layer in layers}
    own: dict[Layer, float] = {}
    for ids, states in vocabulary_states(model, prompt[:t], layers, batch=chunk):
        mine = ids == prompt[t]
        for layer in layers:
            h = truth[layer]
            dist = (states[layer].double() - h).norm(dim=1) / h.norm()
            if mine.any():
                own[layer] = float(dist[mine][0])
                dist[mine] = float("inf")
            i = int(dist.argmin())
            if float(dist[i]) < best[layer][0]:
                best[layer] = (float(dist[i]), int(ids[i]))
    return {layer: Nearest(best[layer][0], best[layer][1], own[layer]) for layer in layers}


def near_inputs(model: LoadedModel, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``[len(tokens), k]`` (CPU): for each of ``tokens``, the ``k`` other tokens whose input vectors lie nearest its
    own in angle (the largest cosine first), its tied twins left out (a bit-identical input vector gives the same
    state: :mod:`lminvert.models.ties`, which the acceptor handles as such)."""
    vocab = model.probe.vocab_matrix(torch.float32)
    norms = derived(model.memo, "vocab-norms", vocab, lambda: vocab.norm(dim=1).clamp_min(1e-30))  # [V]
    tokens = tokens.long().cpu()
    rows = vocab[tokens.to(vocab.device)]
    cosine = ((rows @ vocab.T) / (rows.norm(dim=1, keepdim=True).clamp_min(1e-30) * norms)).cpu()  # [n, V]
    twins = tied_twins(model)
    for row, token in enumerate(tokens.tolist()):
        cosine[row, [token, *twins.get(token, ())]] = -math.inf
    return cosine.topk(min(k, cosine.shape[1] - 1), dim=1).indices
