"""Per model and layer, computed once and cached: the first-position table and the position-1 prior map.

Position 0 has no prefix, so its state depends on the token alone: recovering it is a nearest-neighbour
look-up in the table of all |V| first-position states. (At middle layers the first position is an attention
sink with a norm ~100x the others, which makes gradient signals there useless.) Position 1 sees only the
first token and itself; a secant map fitted over random first tokens is a good prior for the linear policy.

Both are built with the batched forwards of :mod:`lminvert.forward` and written atomically to
``<cache>/tables/<weights hash>-<dtype>-layer<L>...safetensors``, with the :func:`provenance` that made them in the
file's metadata: an entry made under another provenance (torch or transformers version, CPU features, GPU, numeric
path) is recomputed, never reused; a loaded model keeps them in memory
(on its own :attr:`~lminvert.models.LoadedModel.memo`, so edited weights never see stale tables). Files hold CPU
float32 tensors whatever the device that built them; a table read from disk is moved to the model's device. They
are keyed by the model's dtype: a bfloat16 model builds its own (its states differ from float32's by more than
the gaps a table has to resolve at some positions), and reads it on any device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from ..cpu import cpu_features
from ..forward import vocabulary_states
from ..models import Layer, LoadedModel
from ..models.probe import has_hooks
from ..paths import atomic_file, building, cache_dir
from .secant import centre, fit_secant_map

log = logging.getLogger(__name__)


def table_path(
    model: LoadedModel, layer: Layer, kind: str, device: str | None = None, dtype: str | None = None
) -> Path:
    """Where a table of ``kind`` for this model's weights, dtype (or ``dtype``) and ``layer`` (and device type) is
    kept."""
    suffix = ("" if kind == "table" else f"-{kind}") + (f"-{device}" if device else "")
    name = f"{model.weights_hash}-{dtype or model.dtype}-layer{layer.name}{suffix}.safetensors"
    return cache_dir() / "tables" / name


HALF_BUFFERS = "as-loaded"  # a half model's buffers in the dtypes of one loaded in it (:func:`..models.loading.cast`)
MACHINE = frozenset({"cpu", "gpu"})
"""Provenance that only entries kept per device type compare (radii measured on the kernels that round); the
others (tables, maps) only order candidates that a forward on the model's own device verifies, so one made on a CPU
serves a GPU."""


def provenance(model: LoadedModel) -> dict[str, str]:
    """What made a cache entry besides the weights, dtype, layer and device type its name records: the torch and
    transformers versions, the CPU's features, the GPU's name, the probe's numeric path, and a half model's buffers."""
    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_features(),
        "numeric": model.probe.numeric_path,
    }
    if model.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(model.device)
    if model.dtype != "float32":  # entries a half model made before its buffers were as loaded are recomputed
        out["buffers"] = HALF_BUFFERS
    return out


def read_tables(
    model: LoadedModel,
    layer: Layer,
    kind: str,
    device: str | None = None,
    dtype: str | None = None,
    strict: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The tensors kept on disk under ``kind`` for this model's weights, dtype (or ``dtype``) and ``layer`` (CPU
    tensors), or None: none kept; kept under another :func:`provenance` (to be recomputed; with ``strict=False``, for
    what only orders candidates and costs minutes to remake, returned with a warning instead); or a model whose
    forward hooks change what it computes (its weights hash cannot name that)."""
    path = table_path(model, layer, kind, device, dtype)
    if has_hooks(model.model) or not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:  # the provenance first, the tensors only if it matches
        saved = json.loads((handle.metadata() or {}).get("provenance", "{}"))
        here = provenance(model)
        compared = {*saved, *here} - (set() if device else MACHINE)
        changed = sorted(k for k in compared if saved.get(k) != here.get(k))
        if changed:
            if strict:
                log.info("recomputing %s (cached under another %s)", path.name, ", ".join(changed))
                return None
            if set(changed) - {"numeric", "buffers"}:  # a float32 reader serves a half model of the same weights
                log.warning(
                    "%s was made under another %s: used as it is (it only orders candidates)", path.name, changed
                )
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (a file handle, not a dict)


def write_tables(
    model: LoadedModel, layer: Layer, kind: str, tensors: dict[str, torch.Tensor], device: str | None = None
) -> None:
    """Keep ``tensors`` on disk under ``kind`` (:func:`read_tables`) with their provenance, except for a hooked
    model."""
    if has_hooks(model.model):  # what it computes is not what its weights hash names: keep it off the disk
        return
    meta = {"provenance": json.dumps(provenance(model), sort_keys=True)}
    with atomic_file(table_path(model, layer, kind, device)) as tmp:  # two processes building it cannot collide
        save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(tmp), metadata=meta)


def cached(
    model: LoadedModel, layer: Layer, kind: str, build: Callable[[], torch.Tensor], per_device: bool = False
) -> torch.Tensor:
    """``build()`` once per weights, dtype and layer (and device type, with ``per_device``): kept on the loaded
    model and on disk (a CPU tensor in the file; not for a hooked model), always returned on the model's device."""
    value = kept(model, layer, kind, per_device)
    if value is not None:
        return value
    device = model.device.type if per_device else None
    with build_lock(model, layer, kind, per_device) as waited:
        value = kept(model, layer, kind, per_device) if waited else None  # another process built it meanwhile
        if value is not None:
            return value
        start = time.perf_counter()
        value = build().detach().cpu().contiguous()
        write_tables(model, layer, kind, {"value": value}, device)
    log.info("built %s for layer %s in %.1f s", kind, layer.name, time.perf_counter() - start)
    return _hold(model, layer, kind, per_device, value)


def build_lock(model: LoadedModel, layer: Layer, kind: str, per_device: bool = False) -> AbstractContextManager[bool]:
    """While :func:`cached` (or a build that keeps several entries) builds ``kind`` at ``layer``, other processes
    asking for it wait (:func:`lminvert.paths.building`: yields whether this one waited; nothing for a hooked model,
    whose entries stay off the disk)."""
    if has_hooks(model.model):
        return nullcontext(False)
    device = model.device.type if per_device else None
    path = table_path(model, layer, kind, device)
    what = path.stem.split("-", 1)[-1]  # the entry's name after the weights' hash: dtype, layer, kind, device
    return building(path, what=what + " (the first-position table)" if kind == "table" else what)


def kept(model: LoadedModel, layer: Layer, kind: str, per_device: bool = False) -> torch.Tensor | None:
    """What :func:`cached` keeps of ``kind`` at ``layer``, on the model's device (read from disk once, then held on
    the loaded model), or None: nothing kept under this provenance."""
    key = _key(model, layer, kind, per_device)
    if key in model.memo:
        return model.memo[key]
    stored = read_tables(model, layer, kind, model.device.type if per_device else None)
    if stored is None:
        return None
    (value,) = stored.values()
    return _hold(model, layer, kind, per_device, value)


def _key(model: LoadedModel, layer: Layer, kind: str, per_device: bool) -> tuple:
    return (kind, int(layer), model.dtype, model.device.type if per_device else None)


def _hold(model: LoadedModel, layer: Layer, kind: str, per_device: bool, value: torch.Tensor) -> torch.Tensor:
    """``value`` on the model's device, held on the loaded model for :func:`kept`."""
    if model.device.type == "mps" and value.dtype == torch.float64:  # MPS has no float64
        value = value.float()
    value = value.to(model.device)
    model.memo[_key(model, layer, kind, per_device)] = value
    return value


def squared_norms(model: LoadedModel, name: str, matrix: torch.Tensor) -> torch.Tensor:
    """``||row||^2`` of a matrix the loaded model keeps (the vocabulary, a table), computed once and kept in its memo:
    the nearest-row rankings need them for every prompt (|V|·d flops each, ~50 ms for SmolLM2 on one thread)."""
    key = ("squared-norms", name, model.dtype)
    if key not in model.memo:
        model.memo[key] = matrix.float().square().sum(1)
    return model.memo[key]


def first_position_tables(
    model: LoadedModel, layers: list[Layer], batch: int = 1024, progress: bool = True
) -> dict[Layer, torch.Tensor]:
    """:func:`first_position_table` at each of ``layers``, those not kept yet built together: one pass of the
    vocabulary up to the highest of them (a pass to layer ``L`` costs ``L`` blocks, whatever the number of layers it
    reads), instead of a pass per layer."""
    missing = sorted({layer for layer in layers if kept(model, layer, "table") is None}, key=int)
    if len(missing) > 1:
        desc = f"first-position tables (layers {', '.join(layer.name for layer in missing)})"
        parts = list(vocabulary_states(model, [], missing, batch=batch, progress=progress, desc=desc))
        for layer in missing:
            cached(model, layer, "table", lambda layer=layer: torch.cat([states[layer] for _, states in parts]))
    return {layer: first_position_table(model, layer, batch, progress) for layer in layers}


def first_position_table(model: LoadedModel, layer: Layer, batch: int = 1024, progress: bool = True) -> torch.Tensor:
    """``[V, d]`` float32 states of each token alone at ``layer`` (built and cached on first use;
    :func:`first_position_tables`: several layers in one pass)."""

    def build() -> torch.Tensor:
        desc = f"first-position table (layer {layer.name})"
        parts = vocabulary_states(model, [], [layer], batch=batch, progress=progress, desc=desc)
        return torch.cat([states[layer] for _, states in parts])

    return cached(model, layer, "table", build)


@dataclass(frozen=True)
class FirstTable:
    """What ranks position 0 at ``layer``: every token's state alone at layer ``at`` (``table`` ``[V, d]``, its rows'
    squared norms ``norms``). Where ``at`` is a block layer above ``layer`` (:func:`first_table_for`), a target is
    lifted there first (:meth:`lift`): position 0 attends to itself only, so its observed state at ``layer``, run
    alone through the blocks between, is its token's state alone at ``at``, up to rounding. It only ranks: every
    candidate is verified at ``layer`` and the acceptor decides."""

    table: torch.Tensor
    norms: torch.Tensor
    layer: Layer
    at: Layer
    model: LoadedModel

    def lift(self, target: torch.Tensor) -> torch.Tensor:
        """``target`` ``[d]`` (a position-0 state at :attr:`layer`) as the table's layer holds it (float32)."""
        if self.at == self.layer:
            return target.float()
        probe = self.model.probe
        return probe.states_above(target.to(probe.dtype)[None, None], self.layer, self.at)[0, 0].float()


def first_table_for(model: LoadedModel, layer: Layer, progress: bool = True) -> FirstTable:
    """Position 0's ranking at ``layer``: the layer's own first-position table where one is kept, else the nearest
    kept one at a block layer above it (the preparation keeps the last layer's: a user's first prompt at any layer
    below then ranks position 0 with it instead of building its own, one forward of the whole vocabulary: SmolLM2's
    layer 15, 53 s on a 2-core CPU; the final layer ranks with the last block's through the final norm), else the
    layer's own, built now."""
    at, own = layer, kept(model, layer, "table")
    last = model.probe.layer(model.probe.n_layers)
    if own is None and layer.is_final and model.probe.final_norm is not None and kept(model, last, "table") is not None:
        return _normed_table(model, last, layer)
    if own is None and not layer.is_final and int(layer) < model.probe.n_layers:
        above = model.probe.layers(list(range(int(layer) + 1, model.probe.n_layers + 1)))
        at = next((upper for upper in above if kept(model, upper, "table") is not None), layer)
    if own is None and at == layer:
        log.warning(
            "no first-position table kept at or above layer %s: building its own, once (a forward of every token); "
            "`lminvert models --prepare %s` keeps the last layer's, which ranks position 0 at every layer",
            layer.name, model.name,
        )  # fmt: skip
    table = first_position_table(model, at, progress=progress)  # kept: read from memory
    return FirstTable(table, squared_norms(model, f"table-{at.name}", table), layer, at, model)


def _normed_table(model: LoadedModel, last: Layer, final: Layer) -> FirstTable:
    """The final layer's ranking from the last block's kept table run through the final norm (it acts on each row
    alone: a token's state alone at ``final`` is its state at ``last`` normed, up to rounding); kept in memory."""
    key = ("normed-table", model.dtype)
    if key not in model.memo:
        probe = model.probe
        with torch.no_grad():
            table = probe.final_norm(first_position_table(model, last, progress=False).to(probe.dtype)).float()
        model.memo[key] = (table, squared_norms(model, "table-normed", table))
    table, norms = model.memo[key]
    return FirstTable(table, norms, final, final, model)


POSITION1 = "position1-map"  # the cache's name for the position-1 map
# a view's rows at position 1 from the layer's states (``(name, rows_of)``: :meth:`lminvert.invert.views.View.rows_of`)
Through = tuple[str, Callable[[torch.Tensor, int], torch.Tensor]]


PROJECTION_CACHED = True  # the position-1 map's vocabulary norms kept on disk (:func:`position1_projection`)


def digest(values: torch.Tensor) -> str:
    """12 hex digits of ``values``' float32 bytes: names a cache entry made from them (an entry made from other values
    gets another name)."""
    return hashlib.blake2b(values.float().cpu().contiguous().numpy().tobytes(), digest_size=6).hexdigest()


def _position1_kind(through: Through | None) -> str:
    return POSITION1 if through is None else f"{POSITION1}-{through[0]}"


def second_position_map(model: LoadedModel, layer: Layer, through: Through | None = None) -> torch.Tensor:
    """A secant linear map ``J`` [d, d] from input vectors to position-1 states, for random first tokens
    (:func:`fit_position1_maps`); ``through``: to a view's rows at position 1 instead (``[d, k]``, e.g. a KV
    cache's, whose block reads ``layer``'s states). Built once per model and layer (and view), cached."""
    fit_position1_maps(model, [layer], through=through)
    jac = kept(model, layer, _position1_kind(through))
    assert jac is not None
    return jac


def fit_position1_maps(
    model: LoadedModel,
    layers: list[Layer],
    contexts: int = 12,
    samples: int = 256,
    seed: int = 0,
    outlier: float = 4.0,
    through: Through | None = None,
) -> list[Layer]:
    """The position-1 map of each of ``layers`` not kept yet, kept: a ridge fit over ``contexts`` random first tokens x
    ``samples`` random second tokens (centred per context, attention-sink outliers dropped), all layers from one pass
    of the same draws up to the highest of them (each layer's map is the one it would get alone: the draws do not
    depend on the layer); ``through``: of a view's rows computed from those states (:func:`second_position_map`),
    one layer's view, so with one layer only (a ``ValueError`` else). Returns the layers fitted."""
    if through is not None and len(layers) != 1:
        raise ValueError(f"a view's rows ('{through[0]}') belong to one layer: fit its position-1 map alone")
    kind = _position1_kind(through)
    missing = [layer for layer in layers if kept(model, layer, kind) is None]
    if not missing:
        return []
    probe = model.probe
    gen = torch.Generator().manual_seed(seed)
    vocab = probe.vocab_matrix().cpu().double()
    xs: dict[Layer, list] = {layer: [] for layer in missing}
    hs: dict[Layer, list] = {layer: [] for layer in missing}
    for first in torch.randint(0, probe.vocab_size, (contexts,), generator=gen).tolist():
        ids = torch.randint(0, probe.vocab_size, (samples,), generator=gen)
        ((_, states),) = vocabulary_states(model, [first], missing, tokens=ids, batch=samples)
        for layer in missing:
            h = (states[layer] if through is None else through[1](states[layer], 1)).double()
            keep = h.norm(dim=1) <= outlier * h.norm(dim=1).median()
            x, h = centre(vocab[ids][keep], h[keep])
            xs[layer].append(x)
            hs[layer].append(h)
    for layer in missing:
        fitted = fit_secant_map(torch.cat(xs[layer]), torch.cat(hs[layer]), ridge=1e-3)
        cached(model, layer, kind, lambda fitted=fitted: fitted)
    return missing


def position1_projection(
    model: LoadedModel, layer: Layer, through: Through | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(J, ||e_v J||² for every v)`` of the position-1 map (``through``: a view's, :func:`second_position_map`): the
    linear policy's starting ranking, kept in memory (the ranking needs only the norms and ``J``). The norms cost
    |V|·d·k flops (Gemma-3-270m: 1.5 s of every process's first inversion on a 2-core CPU) and are cached beside the
    map, made on first use (:data:`PROJECTION_CACHED`; False: computed once per loaded model)."""
    key = ("position1-projection", int(layer), model.dtype, _position1_kind(through))
    if key not in model.memo:
        jac = second_position_map(model, layer, through)

        def norms() -> torch.Tensor:
            return (model.probe.vocab_matrix(torch.float32) @ jac.float()).square().sum(1)

        kind = f"{_position1_kind(through)}-norms-{digest(jac)}"  # of this map: a map made anew has its own
        model.memo[key] = (jac, cached(model, layer, kind, norms) if PROJECTION_CACHED else norms())
    return model.memo[key]
