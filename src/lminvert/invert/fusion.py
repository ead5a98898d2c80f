"""The reading's weight in the proposal's fused source, fitted per layer on held-out text (:mod:`.proposal`).

The fused source ranks the vocabulary by the next-token prior's log-probabilities plus ``w`` times the reading's (the
log-softmax of its scores): a product of experts, in which ``w`` says how far the reading's scores are to be believed
against the prior's. How sharp a reading's scores are depends on how it was trained and on the layer, not on anything
the inversion sees, so one weight (:data:`.linear.FUSED`, 1) suits some layers and not others: on 16 held-out prompts
(``benchmarks/bench_first_guess.py``), the true token ranked first by the fused source at Gemma-3-270m's last layer
54% of the time with ``w = 1`` against 66% with ``w = 1/4``, at SmolLM2's layer 30 65% against 69% with ``w = 1/2``.

Here each layer's weight is the one of :data:`WEIGHTS` under which the fused source ranks the true token best (the
lowest mean ``log2(2 + rank)``, what a search pays) on :data:`PROMPTS` text windows drawn with their own seed (neither
the reading maps', the networks' nor the preparation's checks'), from their states as lminvert computes them and the
model's own next-token logits: one forward of the prompts serves every layer. Cached per model, dtype, layer and
reading (a digest of what the reading reads from fixed states, so a network trained later is fitted anew), made for
every layer by the preparation. A model whose tokenizer the corpora cannot serve keeps :data:`.linear.FUSED`. Switch:
:data:`FIT`. The weight only orders candidates: every one is verified and the acceptor alone gives verdicts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from ..forward import prompt_states
from ..models import Layer, LoadedModel
from .proposal import fuse, reading_log_probs
from .reader import reading_for
from .reading import Reading, input_distances, read, training_prompts
from .tables import cached, digest, kept

log = logging.getLogger(__name__)

FIT = True  # each layer's weight fitted on held-out text; False: :data:`.linear.FUSED` at every layer
WEIGHTS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # the weights tried (each twice the one before)
PROMPTS = 8  # text windows fitted on (12 chose the same weight at every layer of SmolLM2, 16 at 27 of 30)
LENGTH = 20  # tokens each
CHUNK = 8  # positions per part of the ranking, which stays in the cache (all at once: SmolLM2's fit 26 s, not 11)
NO_TEXT = "fused-weight-no-text"  # the loaded model's memo: no text windows to fit on
SEED = 777  # their draw (the maps' training prompts: 123; the networks': 321; the preparation's checks: 555)


def fitted_weight(model: LoadedModel, layer: Layer, reading: Reading, default: float) -> float:
    """``layer``'s fitted weight for ``reading`` (see the module docstring; fitted first where none is cached);
    ``default`` where :data:`FIT` is off or the model has no text to fit on."""
    if not FIT:
        return default
    kind = _kind(model, reading)
    _fit_missing(model, {layer: reading}, {layer: kind})
    value = kept(model, layer, kind)
    return default if value is None else float(value[0])


def fit_weights(model: LoadedModel, layers: Sequence[Layer]) -> list[Layer]:
    """Fit and cache the weight at each of ``layers`` for the reading the proposal reads it with
    (:func:`.reader.reading_for`) where none is cached, all from one forward of the prompts; the layers fitted (none
    where the model has no text to fit on)."""
    readings = {layer: reading_for(model, layer) for layer in layers}
    return _fit_missing(model, readings, {layer: _kind(model, reading) for layer, reading in readings.items()})


def _fit_missing(model: LoadedModel, readings: dict[Layer, Reading], kinds: dict[Layer, str]) -> list[Layer]:
    """:func:`fit_weights` of ``readings``, whose cache kinds are ``kinds``."""
    missing = [layer for layer, kind in kinds.items() if kept(model, layer, kind) is None]
    if not missing or model.memo.get(NO_TEXT):
        return []
    prompts = training_prompts(model, text=PROMPTS, random=0, length=LENGTH, seed=SEED)
    if not prompts:  # no text for this tokenizer: not sought again by this loaded model
        model.memo[NO_TEXT] = True
        return []
    weights = _fit(model, prompts, {layer: readings[layer] for layer in missing})
    for layer in missing:
        cached(model, layer, kinds[layer], lambda w=weights[layer]: torch.tensor([w]))
    return missing


def _fit(model: LoadedModel, prompts: list[list[int]], readings: dict[Layer, Reading]) -> dict[Layer, float]:
    """Each layer's best weight of :data:`WEIGHTS` on ``prompts``: their states at every layer and their next-token
    logits from one forward (clean states: the prior the blocks above a layer compute from them is these logits)."""
    probe = model.probe
    top = probe.layer(probe.n_layers)
    states = prompt_states(model, prompts, sorted({*readings, top}, key=int), progress=False)
    truth = torch.tensor([t for ids in prompts for t in ids[1:]], device=probe.device)[:, None]
    ends = torch.cat([row[top][:-1] for row in states]).to(probe.device)
    prior = probe.next_token_logits(ends).float().log_softmax(-1)
    prior -= prior.gather(1, truth)  # each position's scores against its true token's
    chosen = {}
    for layer, reading in readings.items():
        vectors = torch.cat([read(reading, row[layer].to(probe.device))[1:] for row in states])
        scores = reading_log_probs(input_distances(model, vectors, half=True))
        scores -= scores.gather(1, truth)
        costs = [0.0] * len(WEIGHTS)
        for rows in torch.split(torch.arange(len(truth), device=probe.device), CHUNK):  # cache-sized parts
            for i, weight in enumerate(WEIGHTS):
                ranks = (fuse(prior[rows], scores[rows], weight) > 0).sum(1)
                costs[i] += float(torch.log2(2.0 + ranks.double()).sum()) / len(truth)
        best = min(range(len(WEIGHTS)), key=lambda i: (costs[i], abs(math.log2(WEIGHTS[i]))))
        chosen[layer] = WEIGHTS[best]
        means = ", ".join(f"{w:g}: {c:.2f}" for w, c in zip(WEIGHTS, costs, strict=True))
        log.info("fused weight at layer %s: %g (mean log2(2 + rank) %s)", layer.name, WEIGHTS[best], means)
    return chosen


def _kind(model: LoadedModel, reading: Reading) -> str:
    """The cache kind of ``reading``'s weight: a short digest of what it reads from fixed random states (the same for
    the same map or network)."""
    width = model.probe.hidden_size
    fixed = torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(model.probe.device)
    return f"fused-weight-{digest(read(reading, fixed))}"
