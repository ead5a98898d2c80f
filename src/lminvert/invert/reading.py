"""A reading map: each position's token read linearly from its own observed state (and the one before), learnt offline.

The next-token prior (:mod:`.proposal`) predicts position ``t`` from the states before it; it cannot see the token
itself. The state at ``t`` does: the residual stream keeps a linear trace of its input token at every layer (what
the linear policy's secant fit exploits, one position at a time, after verifying candidates). A ridge regression
from ``[h_t / ||h_t||, h_{t-1} / ||h_{t-1}||, 1]`` to the input vector ``e_{x_t}`` (the previous state carries the
context the offset depends on), fitted once per model and layer on sampled text and random token ids and cached
like the first-position table, ranks the vocabulary at every position before anything is verified: by the
distance of each input vector to the map's prediction. It is a proposal, not a decision: every candidate is still
verified, so a poor reading (random token ids, where it is weak) costs time, never exactness.

On SmolLM2 (4 held-out prompts of each kind, 20 tokens): the true token is the map's first guess at 29 of 38 prose
positions at layer 15 and 20 of 38 at layer 30; 4 and 1 of 38 for random token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..corpora import sample_prompts
from ..errors import LminvertError
from ..forward import prompt_states
from ..models import Layer, LoadedModel
from ..models.halfmath import native_bfloat16
from .secant import fit_secant_map
from .tables import cached, squared_norms

log = logging.getLogger(__name__)

TEXT_PROMPTS = 200  # sampled text windows the map is fitted on (code, prose and records)
RANDOM_PROMPTS = 100  # random-id prompts beside them
LENGTH = 24  # tokens per training prompt
RIDGE = 1e-6  # relative to the features' energy
PRODUCTS = torch.float32  # the maps' fits: their Gram and right-hand-side products in this dtype, the solve in float64
# (float64: the products too; SmolLM2, five layers' maps 1.41 against 2.17 s, 1.7e-5 to 4.8e-5 of their norm apart,
# 80 held-out prompts' 1,840 positions ranked as before: docs/results.md)
SEED = 123  # the training prompts' draw (the evaluation prompts use seed 0)
RECORDS = 0.25  # the part of the text windows drawn from the synthetic records (:mod:`lminvert.corpora`)


Reading = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a linear map ``[2d + 1, d]`` or a network


def features(states: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, 2d + 1]``: each position's unit state, the previous position's (zeros before the first), and a 1. With
    ``previous`` (a state ``[d]``), the rows are alternatives at one position (candidates' states) and all follow it."""
    unit = states.double() / states.double().norm(dim=1, keepdim=True).clamp_min(1e-30)
    if previous is None:
        before = torch.cat([torch.zeros_like(unit[:1]), unit[:-1]])
    else:
        before = (previous.double() / previous.double().norm().clamp_min(1e-30)).to(unit.device).expand_as(unit)
    return torch.cat([unit, before, torch.ones_like(unit[:, :1])], dim=1)


def read(weights: Reading, states: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
    """The input vectors ``[N, d]`` (float32) that the map or network ``weights`` reads from ``states`` (the rows of
    :func:`features`, with ``previous`` as there)."""
    inputs = features(states, previous).float()
    with torch.no_grad():
        return (weights(inputs) if callable(weights) else inputs @ weights).float()


def training_prompts(
    model: LoadedModel,
    text: int = TEXT_PROMPTS,
    random: int = RANDOM_PROMPTS,
    length: int = LENGTH,
    seed: int = SEED,
) -> list[list[int]]:
    """``random`` prompts of random token ids, then ``text`` sampled text windows (when the model has a tokenizer the
    corpora can serve; those of at least 2 tokens), ``length`` tokens each, drawn with ``seed``: what the reading map
    (these defaults) and a reading network (:mod:`.reader`, its own) are fitted on. The windows: :data:`RECORDS` of
    them from the synthetic records (other languages, identifiers, secrets), the rest from the mixed code and prose.
    The records took the quick network's mean ``log2(2 + rank)`` at SmolLM2's layer 30 from 3.88 to 3.22 and 3.97 to
    3.10 on two held-out sets (1,500 training prompts), and from 2.01 to 2.17 on the corpora's own windows
    (docs/results.md)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.probe.vocab_size, (random, length), generator=gen).tolist()
    if model.tokenizer is not None and text:
        records = round(text * RECORDS)
        try:
            for corpus, count in (("mixed", text - records), ("records", records)):
                if not count:
                    continue
                windows, _ = sample_prompts(model.tokenizer, corpus, count, max_tokens=length, seed=seed)
                prompts += [list(p.ids) for p in windows if len(p.ids) >= 2 and max(p.ids) < model.probe.vocab_size]
        except LminvertError as exc:  # a tokenizer the corpora cannot serve: random ids alone
            log.info("training prompts without text (%s)", exc)
    return prompts


def half_states(model: LoadedModel, asked: bool | None) -> bool:
    """Whether a training forward (:func:`training_states`) runs its products in bfloat16: as ``asked``, else for a
    float32 model where bfloat16 GEMMs are native (:func:`lminvert.models.halfmath.native_bfloat16`; a half model's
    forward is half already)."""
    if asked is not None:
        return asked and model.probe.dtype == torch.float32
    return model.probe.dtype == torch.float32 and native_bfloat16(model.probe.device)


def training_states(
    model: LoadedModel, prompts: list[list[int]], layers: Sequence[Layer], half: bool, progress: bool
) -> list[dict[Layer, torch.Tensor]]:
    """Training prompts' float32 states at ``layers``; ``half``: from a forward whose products run in bfloat16
    (``torch.autocast``), for what only learns to read states. A reading learns from states about 1% off a float32
    forward's and reads exact ones just as well, from about half the forward's time (this project's AVX512-BF16 CPU,
    SmolLM2): the reading network at layer 30, 1,500 prompts, 30 s against 54 s, held-out mean ``log2(2 + rank)`` 3.47
    against 3.48 on the deep benchmark's prompts; the linear maps' 300 prompts at 4 layers, 6.8 s against 12.0 s, and
    the same held-out ranks at layers 5, 15, 25 and 30 (docs/results.md). The inversion's own forwards keep the
    model's dtype."""
    device = model.probe.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
        states = prompt_states(model, prompts, layers, progress=progress)
    return [{layer: state.float() for layer, state in row.items()} for row in states]


def reading_map(model: LoadedModel, layer: Layer) -> torch.Tensor:
    """``W`` ``[2d + 1, d]`` (float32, on the model's device): built once per model, dtype and layer, cached."""
    return reading_maps(model, [layer])[layer]


def reading_maps(
    model: LoadedModel, layers: Sequence[Layer], shared: dict[str, list] | None = None
) -> dict[Layer, torch.Tensor]:
    """:func:`reading_map` at each of ``layers``; those not cached yet are fitted on one forward of the training
    prompts that computes all of them (what :func:`lminvert.invert.preparation.prepare` does for every layer).
    ``shared``: an empty dict that receives that forward's ``prompts`` and ``states`` (``[T, d]`` per layer) where it
    ran, for another use of the same states (the preparation trains its reading network on them too)."""
    # the training prompts and their states, made by the first layer not cached
    shared = {} if shared is None else shared
    targets: list[torch.Tensor] = []  # the input vectors of the prompts' tokens: the same at every layer

    def build(layer: Layer) -> torch.Tensor:
        if not shared:
            shared.update(training_forward(model, layers))
        if not targets:
            vocab = model.probe.vocab_matrix(torch.float32).cpu().double()
            targets.append(torch.cat([vocab[torch.tensor(p[1:])] for p in shared["prompts"]]))
        x = torch.cat([features(s[layer])[1:] for s in shared["states"]])  # position 0 is the first-position table's
        return fit_secant_map(x.to(PRODUCTS), targets[0].to(PRODUCTS), ridge=RIDGE, solve=torch.float64).float()

    return {layer: cached(model, layer, "reading-map", lambda layer=layer: build(layer)) for layer in layers}


def training_forward(model: LoadedModel, layers: Sequence[Layer]) -> dict[str, list]:
    """The maps' training ``prompts`` and their ``states`` at ``layers`` (``[T, d]`` per layer and prompt), from one
    forward whose products run in bfloat16 where those are native (:func:`half_states`): what :func:`reading_maps` fits
    on and shares."""
    prompts = training_prompts(model)
    return {"prompts": prompts, "states": training_states(model, prompts, layers, half_states(model, None), False)}


def reading_orders(model: LoadedModel, weights: Reading, states: torch.Tensor, depth: int) -> torch.Tensor:
    """``[T, depth]``: at every position of one prompt, the ``depth`` tokens whose input vectors lie nearest the
    prediction from the observed ``states`` ``[T, d]`` (nearest first): of the linear map ``weights``, or of a
    reading network (:mod:`.reader`)."""
    return nearest_inputs(model, read(weights, states.to(model.probe.device)), depth)


def nearest_inputs(model: LoadedModel, predicted: torch.Tensor, depth: int) -> torch.Tensor:
    """``[N, depth]``: the ``depth`` tokens whose input vectors lie nearest each row of ``predicted`` ``[N, d]``."""
    return input_distances(model, predicted).topk(depth, dim=1, largest=False).indices  # nearest first


def input_distances(model: LoadedModel, predicted: torch.Tensor, half: bool = False) -> torch.Tensor:
    """``[N, |V|]``: ``||e_v - p||^2 - ||p||^2`` for each row ``p`` of ``predicted`` and every token's input vector
    ``e_v`` (the same order as the distance; float32, on the model's device). ``half``: the product runs on the probe's
    bfloat16 copy of the vocabulary where such GEMMs are native (:meth:`lminvert.models.LayerProbe.low_vocab`; ``p.e_v``
    to about 3 significant digits; 2.6x faster on this project's AVX512-BF16 CPU, SmolLM2, 512 rows), for checks that
    only compare readings: proposals keep float32 (on Gemma-3-270m's last layer it changed the candidates of 4 of 10
    prompts, some up by 20%, for no gain in time)."""
    vocab = model.probe.vocab_matrix(torch.float32)
    norms = squared_norms(model, "vocabulary", vocab)[None]
    low = model.probe.low_vocab() if half else None
    if low is not None:
        return norms - 2.0 * (predicted.to(low.device, torch.bfloat16) @ low.T).float()
    return norms - 2.0 * predicted.to(vocab.device) @ vocab.T


RANK_CHUNK = 8192  # vocabulary rows per product in :func:`true_ranks`


def true_ranks(model: LoadedModel, predicted: torch.Tensor, tokens: torch.Tensor, half: bool = False) -> torch.Tensor:
    """``[N]`` (int64): for each row ``p`` of ``predicted``, how many tokens' input vectors lie strictly nearer ``p``
    than token ``tokens[i]``'s, by :func:`input_distances`' order and products (``half`` included: each ``p . e_v`` is
    rounded to bfloat16 as that product's output is). Counted over the vocabulary ``RANK_CHUNK`` rows at a time,
    without the ``[N, |V|]`` matrix: for the preparation's checks, 2.1x faster than ranking :func:`input_distances`
    (SmolLM2, 512 rows, bfloat16 products, this project's AVX512-BF16 CPU). The true token's own product is computed
    apart (and the token itself never counted), so a token whose distance ties the true one's to the last bit may count
    or not."""
    vocab = model.probe.vocab_matrix(torch.float32)
    norms = squared_norms(model, "vocabulary", vocab)
    low = model.probe.low_vocab() if half else None
    rows = vocab if low is None else low
    p = predicted.to(rows.device, rows.dtype)
    tokens = tokens.to(rows.device)
    own = (p.float() * rows[tokens].float()).sum(1).to(rows.dtype).float()
    true = (norms[tokens] - 2.0 * own)[:, None]
    count = torch.zeros(len(p), dtype=torch.int64, device=rows.device)
    index = torch.arange(len(p), device=rows.device)
    for first in range(0, len(rows), RANK_CHUNK):
        scores = norms[first : first + RANK_CHUNK][None] - 2.0 * (p @ rows[first : first + RANK_CHUNK].T).float()
        here = (tokens >= first) & (tokens < first + scores.shape[1])  # the true token is never nearer than itself
        scores[index[here], tokens[here] - first] = torch.inf
        count += torch.count_nonzero(scores < true, dim=1)
    return count
