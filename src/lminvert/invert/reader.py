"""A reading network: each position's token read from its own observed state by a small MLP, trained offline.

The reading map (:mod:`.reading`) reads the input token back from a position's state with one linear map. At the
last layers that reading is weak (SmolLM2 layer 30: the true token's place among 49,152 in the thousands at most
positions of random-id prompts, and at subword pieces of text), and those positions cost thousands of verified
candidates. The same features through a two-layer MLP (``[h_t/||h_t||, h_{t-1}/||h_{t-1}||, 1]`` -> 2,048 -> 2,048 ->
an input vector, GELU), trained with a softmax of the scores the proposal ranks by (``2 p.e_v - ||e_v||^2``) over the
batch's tokens and 8,192 rows drawn from the vocabulary at each step, reads them: measured on the benchmark prompts
at every 3rd layer, see docs/results.md. At SmolLM2's last layer the softmax over the whole vocabulary
(``negatives=0``, 1,243 s against 604 s to train there) cost 0.48x the candidates per position of the sampled one
on the benchmark prompts and 0.61x on held-out ones: the random-id prompts (text prompts: some better, some worse;
same-run A/B), and 4,000 random-id training prompts instead of 1,000 (``random=4000``, 1,780 s) cut that layer's
candidates per position again: 41.4 -> 8.7 on the benchmark prompts, 37.8 -> 20.7 on held-out ones (the random-id
prompts 7-20x fewer; one text prompt 26 -> 54; same-run A/B), so ``make readers`` trains that layer with both.

Training costs minutes per layer (SmolLM2 on this project's 2-core CPU: the forwards of 120,000 tokens, ~1 min at
layer 9 and ~5 min at layer 30, then ~45 s per epoch in float32, ~3 min over the whole vocabulary), ~2.5-3x less with
its products in bfloat16 where those are native (:func:`bfloat16_training`; the same held-out ranks,
``benchmarks/bench_reader.py``), so it never happens implicitly: ``lminvert models --prepare ALIAS --reader LAYERS``
(or :func:`train_reader`) trains and caches it beside the tables, and inversion uses it wherever it is cached,
instead of the linear map. Like the linear map it is a proposal, not a decision: every candidate is still verified,
so a poor reading costs time, never exactness.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from ..models import Layer, LoadedModel
from ..models.halfmath import native_bfloat16
from . import reading
from .reading import Reading, features, reading_map, training_states
from .tables import read_tables, squared_norms, write_tables

log = logging.getLogger(__name__)

KIND = "reader"
QUICK_KIND = "reader-quick"  # a network the preparation trains in its time (:mod:`.preparation`); KIND's comes first
BORROWED_KIND = "reader-borrowed"  # the layer whose network a layer without its own reads with (:mod:`.preparation`)
HIDDEN = 2048
TEXT_PROMPTS = 4000  # sampled text windows (code, prose and records: :func:`.reading.training_prompts`)
RANDOM_PROMPTS = 1000  # random-id prompts beside them
LENGTH = 24
EPOCHS = 6
BATCH = 512
NEGATIVES = 8192  # vocabulary rows beside a batch's own tokens in each step's softmax (0: the whole vocabulary)
SEED = 321  # the training prompts' draw (the benchmark's prompts use seed 0)
RANKED_ROWS = 512  # readings ranked against the vocabulary per product in held_out_ranks
STATES_BYTES = 4 << 30  # the training prompts' states kept for several layers at once (train_readers)


def _network(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs)
    )


def _scores(
    read: torch.Tensor, tokens: torch.Tensor, vocab: torch.Tensor, norms: torch.Tensor, negatives: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The proposal's scores ``2 p.e_v - ||e_v||^2`` of a batch's readings over the vocabulary, or over its own tokens
    and ``negatives`` uniformly drawn rows; and each row's target column."""
    size = vocab.shape[0]
    if not 0 < negatives < size:
        return 2.0 * read @ vocab.T - norms[None], tokens
    drawn = torch.randperm(size, device=vocab.device)[:negatives]
    columns = torch.unique(torch.cat([tokens, drawn]))  # sorted
    targets = torch.searchsorted(columns, tokens)
    logits = 2.0 * read @ vocab[columns].T - norms[columns][None]
    others = 1.0 - nn.functional.one_hot(targets, len(columns)).to(logits.dtype)
    logits = logits + math.log(size / len(columns)) * others
    return logits, targets


def bfloat16_training(device: torch.device) -> bool:
    """Whether training runs its products in bfloat16 (``torch.autocast``; weights, optimiser and loss stay float32):
    on a GPU, and on a CPU whose bfloat16 GEMMs are native (at most 0.75x float32's time; this project's AVX512-BF16
    CPU: ~0.3x; an AVX2 CPU emulates them at ~4x): :func:`lminvert.models.halfmath.native_bfloat16`."""
    return native_bfloat16(device)


def load_reader(model: LoadedModel, layer: Layer) -> nn.Module | None:
    """The reading network cached for this model, dtype and layer, else the one trained in float32 for the same
    weights (it only orders candidates, and a half model's states differ from float32's by their rounding): one that
    ``--reader`` trained, else the preparation's quick one (:data:`QUICK_KIND`), else the network of the layer the
    preparation found it reads this layer's states better than its linear map (:data:`BORROWED_KIND`, a deeper
    layer's); or None (it is never trained here; a model whose forward hooks change what its weights compute reads no
    file: the weights hash cannot name what it computes)."""
    key = (KIND, int(layer), model.dtype)
    if key not in model.memo:
        net = weights = None
        for kind in (KIND, QUICK_KIND):
            weights = weights or _stored(model, layer, kind)
        if weights is not None:
            shapes = [weights[f"{i}.weight"].shape for i in (0, 2, 4)]
            net = _network(shapes[0][1], shapes[0][0], shapes[2][0])
            net.load_state_dict(weights)
            net = net.to(model.device).eval().requires_grad_(False)
        elif (source := lent_from(model, layer)) is not None and source >= 0 and source != int(layer):
            net = load_reader(model, model.probe.layer(source))
        model.memo[key] = net
    return model.memo[key]


def _stored(model: LoadedModel, layer: Layer, kind: str) -> dict[str, torch.Tensor] | None:
    """``kind``'s tensors kept for this model's dtype at ``layer``, else for float32 (see :func:`load_reader`)."""
    weights = read_tables(model, layer, kind, strict=False)
    if weights is None and model.dtype != "float32":
        weights = read_tables(model, layer, kind, dtype="float32", strict=False)
    return weights


def lent_from(model: LoadedModel, layer: Layer) -> int | None:
    """What the preparation decided for ``layer`` (:data:`BORROWED_KIND`): the layer whose network it reads with, -1
    where its own linear map reads it better, None where nothing was decided."""
    decided = _stored(model, layer, BORROWED_KIND)
    return None if decided is None else int(decided["layer"])


def lend(model: LoadedModel, layer: Layer, source: Layer) -> None:
    """Keep that ``layer`` reads with ``source``'s network (:data:`BORROWED_KIND`; :func:`load_reader`) and use it in
    this model's inversions."""
    write_tables(model, layer, BORROWED_KIND, {"layer": torch.tensor([int(source)])})
    model.memo[(KIND, int(layer), model.dtype)] = load_reader(model, source)


def reading_for(model: LoadedModel, layer: Layer) -> Reading:
    """What the proposal reads each position's token with: the reading network where one is cached (at the final
    layer without one, the last block's through the final norm: :func:`through_final_norm`), else the linear reading
    map (built and cached on first use)."""
    network = load_reader(model, layer)
    if network is None and layer.is_final:
        network = through_final_norm(model)
    return network if network is not None else reading_map(model, layer)


def through_final_norm(model: LoadedModel) -> Reading | None:
    """The last block's network reading final-layer states: a final state is the last block's state scaled to unit
    RMS and multiplied by the norm's gain coordinate by coordinate, so divided by the gain it has the last block's
    direction, and the network reads unit states (:func:`.reading.features`). None where the last block has no
    network or the final norm is not such a scaling (a LayerNorm centres its input; a zero gain loses a coordinate)."""
    probe = model.probe
    network = load_reader(model, probe.layer(probe.n_layers))
    if network is None or probe.final_norm is None:
        return None
    width = probe.hidden_size
    with torch.no_grad():  # the gain, and whether the norm is a scaling by it: one random state checked
        gain = probe.final_norm(torch.ones(1, width, device=probe.device, dtype=probe.dtype)).float()[0]
        state = torch.randn(1, width, generator=torch.Generator().manual_seed(0)).to(probe.device)
        normed = probe.final_norm(state.to(probe.dtype)).float()
        scaled = gain * state / state.square().mean().sqrt()
    if bool((gain == 0).any()) or not torch.allclose(normed, scaled, rtol=1e-2, atol=1e-3 * float(scaled.abs().max())):
        return None

    def read(inputs: torch.Tensor) -> torch.Tensor:
        """:func:`.reading.features` of final states as the last block's: its unit parts divided by the gain and made
        unit again (a zero row, before position 0, stays zero)."""
        state, before, one = inputs.split([width, width, 1], dim=1)
        unit = [x / x.norm(dim=1, keepdim=True).clamp_min(1e-30) for x in (state / gain, before / gain)]
        return network(torch.cat([*unit, one], dim=1))

    return read


def training_prompts(
    model: LoadedModel, text: int = TEXT_PROMPTS, random: int = RANDOM_PROMPTS, length: int = LENGTH, seed: int = SEED
) -> list[list[int]]:
    """The reading network's training prompts: :func:`.reading.training_prompts` with the network's defaults."""
    return reading.training_prompts(model, text, random, length, seed)


def train_reader(
    model: LoadedModel,
    layer: Layer,
    text: int = TEXT_PROMPTS,
    random: int = RANDOM_PROMPTS,
    length: int = LENGTH,
    epochs: int = EPOCHS,
    hidden: int = HIDDEN,
    seed: int = SEED,
    lr: float = 1e-3,
    negatives: int = NEGATIVES,
    progress: bool = True,
    data: tuple[list[list[int]], Sequence[dict[Layer, torch.Tensor]]] | None = None,
    bfloat16: bool | None = None,
    cache: bool = True,
    kind: str = KIND,
) -> nn.Module:
    """Train the reading network for ``layer`` on sampled text and random ids, cache it, and return it.

    Each step's softmax runs over the batch's own tokens and ``negatives`` vocabulary rows drawn uniformly without
    replacement (the other rows' logits raised by ``log(|V| / drawn)``, so the sum estimates the whole vocabulary's);
    ``negatives=0`` or at least the vocabulary's size: the whole vocabulary. The vocabulary product is most of a step's
    cost: with 8,192 of SmolLM2's 49,152 rows an epoch took ~1 min on this project's CPU, against ~3 min over the whole
    vocabulary (two separate runs). ``data``: the training prompts and their states at ``layer`` (among others),
    computed already (:func:`train_readers` computes them once for several layers; ``text``, ``random`` and ``length``
    are then unused). ``bfloat16``: the products in bfloat16, the training prompts' forward's too
    (:func:`training_states`; None: where :func:`bfloat16_training` says they are fast, the forward's where the model
    is float32 too). ``cache=False``: neither written to the cache nor used by this model's inversions (an experiment's
    network). ``kind``: the cache entry it is written to (:data:`QUICK_KIND`: the preparation's)."""
    start = time.perf_counter()
    probe = model.probe
    if data is None:
        prompts = training_prompts(model, text, random, length, seed)
        data = prompts, training_states(model, prompts, [layer], reading.half_states(model, bfloat16), progress)
    prompts, states = data
    inputs = torch.cat([features(s[layer])[1:] for s in states]).float()  # position 0: the first-position table's
    tokens = torch.cat([torch.tensor(p[1:]) for p in prompts]).to(probe.device)
    vocab = probe.vocab_matrix(torch.float32)
    norms = squared_norms(model, "vocabulary", vocab)
    if bfloat16 is None:
        bfloat16 = bfloat16_training(probe.device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = _network(inputs.shape[1], hidden, vocab.shape[1]).to(probe.device)
        optimiser = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
        inputs = inputs.to(probe.device)
        for epoch in range(epochs):
            loss = _epoch(net, optimiser, inputs, tokens, (vocab, norms, negatives), bfloat16)
            log.info("reading network, layer %s, epoch %d: loss %.3f", layer.name, epoch + 1, loss)
    net = net.eval().requires_grad_(False)
    if cache:
        keep(model, layer, net, kind)
    seconds, products = time.perf_counter() - start, "bfloat16" if bfloat16 else "float32"
    log.info("trained the reading network for layer %s in %.1f s (%s products)", layer.name, seconds, products)
    return net


def keep(model: LoadedModel, layer: Layer, net: nn.Module, kind: str = KIND) -> None:
    """Cache ``net`` as ``layer``'s reading network under ``kind`` and use it in this model's inversions (a hooked
    model keeps it in memory only, like the tables)."""
    write_tables(model, layer, kind, net.state_dict())
    model.memo[(KIND, int(layer), model.dtype)] = net


def held_out_ranks(
    model: LoadedModel, weights: Reading, prompts: Sequence[Sequence[int]], states, half: bool = False
) -> list[int]:
    """The true token's rank among the vocabulary by the proposal's distance from what ``weights`` (a map or a
    network) reads, at positions 1 on of ``prompts`` (``states``: each prompt's ``[T, d]`` states at the layer).
    ``half``: the products with the vocabulary in bfloat16 (:func:`.reading.input_distances`), ranks a few places off
    where scores nearly tie: for the preparation's checks, which only choose between two readings."""
    device = model.probe.device
    read = torch.cat([reading.read(weights, observed.to(device))[1:] for observed in states])
    tokens = torch.tensor([t for ids in prompts for t in ids[1:]], device=device)
    ranks: list[int] = []
    for start in range(0, len(read), RANKED_ROWS):  # many rows per product: one row at a time re-reads the vocabulary
        part = slice(start, start + RANKED_ROWS)
        ranks += reading.true_ranks(model, read[part], tokens[part], half).tolist()
    return ranks


def _epoch(
    net: nn.Module,
    optimiser: torch.optim.Optimizer,
    inputs: torch.Tensor,
    tokens: torch.Tensor,
    softmax: tuple[torch.Tensor, torch.Tensor, int],
    bfloat16: bool,
) -> float:
    """One pass over the examples in random order, in batches of ``BATCH``; returns the mean loss. ``softmax``: the
    vocabulary, its squared norms and the negatives drawn per step (:func:`_scores`)."""
    vocab, norms, negatives = softmax
    order = torch.randperm(len(inputs), device=inputs.device)
    total = 0.0
    for first in range(0, len(order), BATCH):
        rows = order[first : first + BATCH]
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bfloat16):
            logits, targets = _scores(net(inputs[rows]), tokens[rows], vocab, norms, negatives)
        loss = nn.functional.cross_entropy(logits.float(), targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        total += float(loss.detach()) * len(rows)
    return total / len(order)


def train_readers(
    model: LoadedModel,
    layers: Sequence[Layer],
    text: int = TEXT_PROMPTS,
    random: int = RANDOM_PROMPTS,
    length: int = LENGTH,
    seed: int = SEED,
    progress: bool = True,
    extra: tuple[list[list[int]], Sequence[dict[Layer, torch.Tensor]]] | None = None,
    half_states: bool | None = None,
    **options,
) -> dict[Layer, nn.Module]:
    """:func:`train_reader` at each of ``layers`` with the same ``options``, the training prompts' states computed by
    one forward for as many layers as :data:`STATES_BYTES` holds (a forward to layer 27 computes layers 3-24 on its
    way). SmolLM2, 500 of the training prompts, layers 3-27 on this project's 2-core CPU: one pass per layer 69.5 s,
    one pass for all 14.5 s (``make readers``' forwards at those layers: ~12 min -> ~2.5 min at the default 5,000).
    ``extra``: more training prompts and their states at every one of ``layers``, computed already (the reading maps'
    forward, :func:`lminvert.invert.preparation.prepare`). ``half_states``: the training prompts' forward with its
    products in bfloat16 (:func:`training_states`; None: as ``bfloat16`` says where it is given, else for a float32
    model where bfloat16 GEMMs are native)."""
    if not layers:
        return {}
    half = reading.half_states(model, options.get("bfloat16") if half_states is None else half_states)
    prompts = training_prompts(model, text, random, length, seed)
    per_layer = 4 * model.probe.hidden_size * sum(len(p) for p in prompts)  # float32 states of one layer
    group = max(1, STATES_BYTES // max(1, per_layer))
    ordered = sorted(layers)
    trained: dict[Layer, nn.Module] = {}
    for first in range(0, len(ordered), group):
        chunk = ordered[first : first + group]
        data = prompts, training_states(model, prompts, chunk, half, progress) if prompts else []
        if extra is not None:  # prompts whose states are computed already, at every layer of ``layers``
            data = data[0] + list(extra[0]), list(data[1]) + list(extra[1])
        for layer in chunk:
            trained[layer] = train_reader(model, layer, seed=seed, progress=progress, data=data, **options)
        del data
    return trained
