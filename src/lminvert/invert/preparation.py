"""What a model's one-time preparation (``lminvert models --prepare``) makes for inversion, so that a fresh machine
inverts at every layer as a prepared one does, and nothing is built on a user's first prompt that could be built here.

* the linear reading map (:mod:`.reading`) at every layer, fitted on one forward of its training prompts that
  computes all layers at once (built on first use, it costs that forward per layer: seconds at layer 1, a minute at
  SmolLM2's last), and from the same states the map that reads a KV cache's rows back as states at every block after
  the first (:mod:`.rows.back`);
* a quick reading network (:mod:`.reader`, cached as :data:`.reader.QUICK_KIND`) at the last :attr:`Preparation.deep`
  layers, where the linear map reads the token worst: fewer training prompts (3,000 against 5,000), a smaller network
  and fewer vocabulary rows per step than ``--reader``'s, trained in the preparation's time, on its own prompts and the
  maps' (their states come from the maps' forward; its own prompts' forward runs its products in bfloat16 where those
  are native, :func:`.reader.train_readers`, which doubled its prompts for the same forward time: SmolLM2's layer 30
  inverted in 0.81x the time, docs/results.md); a network ``--reader`` trained is used before it. Inversion reads with a
  network *instead of* the linear map, so a network is kept only where it reads held-out prompts better than the map (a
  lower mean ``log2(2 + rank)`` of the true token; prompts drawn with their own seed): a quick network trained too
  briefly read SmolLM2's last layer worse than the map and doubled its candidates (docs/results.md);
* the quick network lent to the layers of the model's upper half that it reads better than their own linear maps
  (checked on the same held-out prompts, once per layer; :func:`.reader.lend`): a network trained on the last layer's
  states reads the layers just below it too, where the linear map is nearly as weak;
* with ``tables``, what a layer's first prompt would otherwise build: the first-position table at the last
  :attr:`Preparation.deep` layers (one forward of every token alone: SmolLM2's last layer 112 s of a fresh machine's
  first prompt on an AVX-512 CPU, 132 s on an AVX2 one), which ranks position 0 at every layer below them too (a
  position-0 state lifted to the table's layer, :func:`.tables.first_table_for`), and every layer's position-1
  map and radii's calibrations, and the reading's weight in the proposal's fused source (:mod:`.fusion`), each kind
  measured for all layers in one pass.

Like every reading, these only order candidates: each one is verified and the acceptor alone gives verdicts, so they
change speed, never an answer. :func:`prepare` skips what is cached already (idempotent).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..forward import prompt_states
from ..models import Layer, LoadedModel
from ..models.halfmath import native_bfloat16
from .fusion import fit_weights
from .reader import BORROWED_KIND, QUICK_KIND, held_out_ranks, keep, lend, lent_from, load_reader, train_readers
from .reading import RANDOM_PROMPTS, reading_map, reading_maps, training_prompts
from .rows.back import back_maps
from .tables import first_position_table, fit_position1_maps, table_path, write_tables
from .tolerance import calibrate_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare` makes: reading maps at every layer (``maps``), quick networks at the last ``deep`` layers,
    trained with ``network``'s options of :func:`.reader.train_reader` and checked on ``check`` held-out prompts
    (text windows and random ids, half each), and with ``tables`` those layers' first-position tables, position-1
    maps and calibrations."""

    maps: bool = True
    tables: bool = True
    deep: int = 1
    network: dict[str, float] = field(
        default_factory=lambda: {
            "text": 2000, "random": 1000, "hidden": 1024, "epochs": 7, "negatives": 2048, "lr": 3e-3,
        }
    )  # fmt: skip
    check: int = 40


def prepare(model: LoadedModel, settings: Preparation = Preparation(), progress: bool = True) -> list[str]:
    """Make what ``settings`` asks for that is not cached yet; one line per part made, with its seconds."""
    done = []
    probe = model.probe
    shared: dict[str, list] = {}  # the maps' training prompts and their states at every layer, where computed here
    if settings.maps:
        start = time.perf_counter()
        layers = probe.layers("all")
        reading_maps(model, layers, shared)
        done.append(f"reading maps at layers 1-{probe.n_layers}: {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()  # the same forward's states read KV caches' rows back (blocks 2..L)
        if made := back_maps(model, shared):  # where the maps were kept already, that forward runs for those missing
            seconds = time.perf_counter() - start
            done.append(f"KV read-back maps at {made} of blocks 2-{probe.n_layers}: {seconds:.1f} s")
    deep = [probe.layer(probe.n_layers - i) for i in range(min(settings.deep, probe.n_layers))]
    wanted = [layer for layer in deep if load_reader(model, layer) is None]
    # the held-out check prompts' states at the deep layers and the upper half's, one forward for both checks
    checks = functools.cache(
        lambda: _check_prompts(model, sorted({*deep, *_upper_half(model)}, key=int), settings.check)
    )
    if wanted:
        start = time.perf_counter()
        options, extra = _network_data(settings.network, shared, wanted)
        shared.clear()  # the maps' states at the other layers are not needed any more
        trained = train_readers(model, wanted, progress=progress, kind=QUICK_KIND, cache=False, extra=extra, **options)
        done += [_kept(model, layer, net, checks) for layer, net in trained.items()]
        done.append(f"quick reading networks trained and checked: {time.perf_counter() - start:.1f} s")
    if deep and (source := load_reader(model, deep[0])) is not None:
        done += _lent(model, deep[0], source, checks)
    if settings.tables:
        done += [line for layer in deep if (line := _layer_table(model, layer, progress))]
        done += _every_layer(model)
    return done


def _layer_table(model: LoadedModel, layer: Layer, progress: bool) -> str | None:
    """``layer``'s first-position table where not cached (a line where it was built, None else). Position 0 at every
    layer below it is then ranked with it (:func:`.tables.first_table_for`)."""
    if table_path(model, layer, "table").is_file():
        return None
    start = time.perf_counter()
    first_position_table(model, layer, progress=progress)
    return f"first-position table at layer {layer.name}: {time.perf_counter() - start:.1f} s"


def _every_layer(model: LoadedModel) -> list[str]:
    """Every layer's position-1 map, calibrations (radii; screening's where the model screens) and fused weight, those
    not cached made in one pass each (:func:`.tables.fit_position1_maps`, :func:`.tolerance.calibrate_layers`,
    :func:`.fusion.fit_weights`): what :func:`lminvert.invert.engine.invert_prompts` reads at a layer, which a
    layer's first prompt would otherwise make (SmolLM2, layer 25: 32 s on a 2-core CPU). A line where any was made."""
    probe = model.probe
    layers = probe.layers([*range(1, probe.n_layers + 1), "final"])
    start = time.perf_counter()
    made = fit_position1_maps(model, layers) + calibrate_layers(model, layers, screen=probe.can_screen)
    lines = []
    if made:
        seconds = time.perf_counter() - start
        lines.append(f"position-1 maps and calibrations at layers 1-{probe.n_layers} and final: {seconds:.1f} s")
    start = time.perf_counter()
    if fit_weights(model, layers):
        seconds = time.perf_counter() - start
        lines.append(f"the fused source's weights at layers 1-{probe.n_layers} and final: {seconds:.1f} s")
    return lines


def _network_data(
    network: dict[str, float], shared: dict[str, list], layers: list[Layer]
) -> tuple[dict[str, float], tuple | None]:
    """The network's options and the prompts it trains on beside its own: the maps' training prompts where their
    states were computed here (one forward for both; their states at ``layers`` only), counted in ``network``'s
    ``random`` and ``text`` prompts (the maps' random ones come first, :func:`.reading.training_prompts`)."""
    if not shared:
        return dict(network), None
    prompts = shared["prompts"]
    random = min(RANDOM_PROMPTS, len(prompts))
    options = dict(network)
    options["random"] = max(0, int(options.get("random", 0)) - random)
    options["text"] = max(0, int(options.get("text", 0)) - (len(prompts) - random))
    return options, (prompts, [{layer: s[layer] for layer in layers} for s in shared["states"]])


CHECK_SEED = 555  # the held-out prompts' draw (the maps' training prompts: 123; the networks': 321)


Checks = Callable[[], tuple[list[list[int]], list[dict]]]  # held-out prompts and their states (:func:`_check_prompts`)


def _kept(model: LoadedModel, layer: Layer, net: torch.nn.Module, checks: Checks) -> str:
    """Keep ``net`` as ``layer``'s quick network where it reads the held-out prompts of ``checks()`` better than the
    linear map; what was decided, as a line."""
    prompts, states = checks()
    scores = {
        name: _score(model, weights, prompts, states, layer)
        for name, weights in (("network", net), ("map", reading_map(model, layer)))
    }
    verdict = f"mean log2(2 + rank) {scores['network']:.2f} against the linear map's {scores['map']:.2f}"
    if scores["network"] < scores["map"]:
        keep(model, layer, net, QUICK_KIND)
        return f"quick reading network at layer {layer.name} kept ({verdict})"
    log.warning("the quick reading network at layer %s reads worse than the linear map: not kept", layer.name)
    return f"quick reading network at layer {layer.name} not kept ({verdict})"


def _check_prompts(model: LoadedModel, layers: list[Layer], count: int) -> tuple[list[list[int]], list[dict]]:
    """``count`` held-out prompts (text windows and random ids, half each) and their states at ``layers``."""
    prompts = training_prompts(model, text=count - count // 2, random=count // 2, seed=CHECK_SEED)
    return prompts, prompt_states(model, prompts, layers, progress=False)


def _score(model: LoadedModel, weights, prompts: list[list[int]], states: list[dict], layer: Layer) -> float:
    """The mean ``log2(2 + rank)`` of the true token where ``weights`` (a map or a network) reads ``layer``'s states;
    the products with the vocabulary in bfloat16 where those are native (:func:`.reader.held_out_ranks`: the
    lending's checks at SmolLM2's 15 layers took 18.8 s, 12.0 s of them in those products)."""
    half = native_bfloat16(model.probe.device)
    ranks = held_out_ranks(model, weights, prompts, [s[layer] for s in states], half=half)
    return sum(math.log2(2 + r) for r in ranks) / len(ranks)


def _upper_half(model: LoadedModel) -> list[Layer]:
    """The block layers of the model's upper half below its last (the layers a deep network may be lent to)."""
    n = model.probe.n_layers
    return model.probe.layers(list(range(max(1, n - n // 2), n)))


def _lent(model: LoadedModel, source: Layer, net: torch.nn.Module, checks: Checks) -> list[str]:
    """The layers of the model's upper half without a network of their own, from the top down, that read the
    held-out prompts of ``checks()`` better with ``source``'s network ``net`` than with their own linear map: each is
    lent it (:func:`.reader.lend`). The first layer down whose map reads better, and those below it, are recorded as
    reading with their maps, so that each layer is decided once. A network trained on the last layer's states reads
    the layers below it too (SmolLM2, the quick network of layer 30 at layers 25-29: mean ``log2(2 + rank)`` 4.3-4.4
    against their maps' 7.2-8.5), less well the lower they are. A line where any layer was decided."""
    layers = [
        layer
        for layer in sorted(_upper_half(model), reverse=True)
        if layer != source and load_reader(model, layer) is None and lent_from(model, layer) is None
    ]
    if not layers:
        return []
    start = time.perf_counter()
    prompts, states = checks()
    lent = []
    for layer in layers:
        own = _score(model, reading_map(model, layer), prompts, states, layer)
        if _score(model, net, prompts, states, layer) >= own:
            break
        lend(model, layer, source)
        lent.append(layer.name)
    for layer in layers[len(lent) :]:
        write_tables(model, layer, BORROWED_KIND, {"layer": torch.tensor([-1])})
    seconds = time.perf_counter() - start
    return [
        f"layer {source.name}'s reading network lent to {len(lent)} of layers {layers[-1].name}-{layers[0].name}, "
        f"where it reads held-out prompts better than their maps ({', '.join(lent) or 'none'}): {seconds:.1f} s"
    ]
