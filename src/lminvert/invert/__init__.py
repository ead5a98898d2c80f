"""Exact prompt inversion from hidden states (SIPIT) and its baselines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import LminvertError
from ..executors import Executor, ModelSetup, get_executor
from ..kv_captures import KVCapture
from ..models import Layer, LayerSpec, LoadedModel
from ..models.compat import check_compatible
from ..models.loading import require_loaded
from ..models.probe import has_hooks
from ..models.ties import tied_token_groups
from ..states import HiddenStates
from .acceptor import UNCERTAIN
from .engine import InvertConfig, invert_prompt, invert_prompts
from .layerfit import resolve_layer
from .leaks import DEFENDED, check_leak, invert_leak, kv_states, view_layer
from .policies import POLICIES, GradientPolicy, LinearPolicy, Policy, RandomPolicy, SweepPolicy
from .results import InversionResult, PositionResult
from .sources import SOURCES, ErrorModel, Exact, Float, Noise, parse_source
from .tolerance import add_noise

METHODS = ("sipit", "bruteforce")

log = logging.getLogger(__name__)


def invert(
    model: LoadedModel,
    states: HiddenStates | torch.Tensor | KVCapture,
    layer: LayerSpec | None = None,
    *,
    method: str = "sipit",
    policy: str = "linear",
    noise: float = 0.0,
    seed: int = 0,
    max_candidates: int | None = None,
    max_seconds: float | None = None,
    first_table: bool = True,
    together: int = 32,
    tolerance_scale: float = 1.0,
    certify: bool | None = None,
    progress: bool = False,
    executor: str | Executor | None = None,
    batch_scale: int | None = None,
    speculate: bool = True,
    screen: bool | None = None,
    source: str | ErrorModel | None = None,
    check: bool = True,
    leak: str = "states",
) -> list[InversionResult]:
    """Recover the token ids of every prompt in ``states`` (one result per prompt, in order).

    ``model`` comes from :func:`lminvert.load_model`, in the dtype the states were computed in (checked against
    the file); everything runs on the model's device. ``layer`` defaults to what the states file says (and must
    agree with it). Up to ``together`` prompts are inverted together: their candidates share one batched forward per
    verification step (``together=1``: one prompt at a time; the recovered ids are the same). ``noise`` adds
    relative Gaussian noise of that level to the states first (for robustness studies) and widens the acceptance
    tolerance to match; ``tolerance_scale`` multiplies the measured acceptance radii (e.g. for states computed on
    other hardware, whose rounding the calibration on this one did not see). ``executor`` runs the chunks of
    ``together`` prompts (default: in this process; ``"ray"``, ``"ray:auto"``: on Ray workers, each loading the
    model once; see :func:`lminvert.executors.get_executor`). ``batch_scale``: candidate batches this many times
    a CPU's (default by device and by how many prompts are inverted together: 16 on CUDA for one prompt, where a
    verification forward costs about the same for 1 or 1,024 candidates; see
    :func:`lminvert.invert.context.batch_scale`); it changes speed only, never the answer. ``speculate``: verify the
    next positions' first guesses in the same forward as a position's first candidates
    (:mod:`lminvert.invert.speculation`; never for a half-precision model on a GPU, whose kernels round chains unlike
    the observer's forward); speed only, never the answer. ``screen``: a float32 model's large candidate
    batches first run with bfloat16 GEMMs and only the candidates near the target are verified in float32, the rest
    before a position would be given up (:mod:`lminvert.invert.engine`); speed only, never the answer. ``None``
    (default): where it pays, a CPU with native bfloat16 GEMMs (:attr:`lminvert.models.LayerProbe.can_screen`).

    ``source``: where the states come from, as an error model (:mod:`lminvert.invert.sources`: ``"exact"``,
    ``"float"``, ``"noise:S"``, ``"quant:B"``); it bounds how far an observed state may lie from what this machine's
    plain forward gives, and the acceptor (:mod:`lminvert.invert.acceptor`) gives each position its verdict with it.
    ``None`` (default): what the states say: ``exact`` for a states file from :func:`lminvert.encode` (it records the
    weights that made it), ``float`` for a bare array (nobody can promise its bits), ``noise:S`` with ``noise``.

    ``layer`` may be left out for states that do not record it (a bare array): it is found from the states
    (:mod:`lminvert.invert.layerfit`), and the result's notes say so. ``check`` (default): states that do not record
    their layer are scored against every layer first, within seconds: a given layer that another one decisively
    beats, or states that fit no layer of the model, raise a one-line error naming the closest layer instead of a
    long search (``check=False``: search the given layer anyway).

    ``leak``: what the rows are (:mod:`lminvert.invert.views`): ``"states"`` (default: every position's state at
    ``layer``), ``"kv"`` (block ``layer``'s KV cache, ``[T, 2 * kv_heads * head_dim]`` per prompt: every head's keys
    after the rotary embedding, then its values, as :func:`lminvert.kv_captures.read_kv` reads a saved cache; block
    ``b`` is transformers' ``cache.layers[b - 1]``) or ``"last"`` (the last position's state alone: a guess of the last
    token). A KV cache, one vector, and states whose ``source`` is ``noise:S`` or ``quant:B`` (not ``noise``, added here
    for robustness studies of the engine) are searched in the rows' own space with the leak's error model
    (:mod:`lminvert.invert.rows`: the first token and missing or ambiguous positions chosen by the next rows; the
    audit's attack); lminvert's own and foreign float states by the engine. A :class:`lminvert.KVCapture` is a ``kv``
    leak whose block, where it records one, is ``layer``.

    ``max_seconds``: a bound on the search, counted from this call: once it has passed, every position stops after its
    first batch of candidates and keeps the closest one verified; the acceptor gives such positions their verdict as
    for any budget (``max_candidates`` bounds candidates instead), and the results' notes count them.

    ``certify``: verify the whole vocabulary at every position (cost: brute force's), so that a colliding second
    token is seen and its position flagged (``PositionResult.certified_exact``). SIPIT stops at the first match,
    which is exact because the model is injective; ``None`` (default) certifies when injectivity cannot be assumed:
    the model carries forward hooks that edit what its weights compute (as the lab's constructions do).
    """
    check_options(method, policy, noise, max_seconds, together, batch_scale, tolerance_scale, max_candidates, source)
    check_leak(leak, method, policy, noise, max_seconds, max_candidates, certify, executor, tolerance_scale)
    deadline = None if max_seconds is None else time.time() + max_seconds
    offsets = None
    if isinstance(states, KVCapture):
        states, layer, leak, offsets = kv_states(states, layer, leak)
    if isinstance(states, torch.Tensor):
        states = HiddenStates.from_array(states.detach().cpu())
    model = require_loaded(model, "invert")
    _check_screen(model, screen)
    error_model = _source(states, source, noise)
    if leak != "states" or (noise == 0 and error_model.name in DEFENDED):  # noise added here: the engine's study
        return _invert_rows(model, states, layer, leak, error_model, check, screen, offsets)
    resolved, found = _layer(model, states, layer, error_model, check)
    config = InvertConfig(
        method=method,
        certify=_certify(model, certify),
        policy=policy,
        first_table=first_table,
        max_candidates=max_candidates,
        deadline=deadline,
        tolerance_scale=tolerance_scale,
        source=error_model,
        seed=seed,
        progress=progress,
        batch_scale=batch_scale,
        speculate=speculate,
        screen=screen,
    )
    flat = _invert_chunks(model, states, resolved, config, noise, together, executor)
    return _with_notes(model, states, found, flat)


def _check_screen(model: LoadedModel, screen: bool | None) -> None:
    """A one-line error where ``screen=True`` was asked of a model that cannot screen (see :func:`invert`)."""
    if screen and (reason := model.probe.screen_refusal) is not None:
        raise LminvertError(
            f"screening runs a float32 model's candidate batches in bfloat16; {reason}: drop --screen (screen=True)"
        )


def _certify(model: LoadedModel, certify: bool | None) -> bool:
    """Whether to certify every position (see :func:`invert`'s ``certify``); ``None``: where the model has hooks."""
    if certify is None:
        certify = has_hooks(model.model)
        if certify:
            log.warning(
                "%s has forward hooks that edit its computation: injectivity cannot be assumed, so every position is "
                "certified against the whole vocabulary (pass certify=False to stop at the first match)",
                model.name,
            )
    return bool(certify)


def _invert_chunks(
    model: LoadedModel,
    states: HiddenStates,
    layer: Layer,
    config: InvertConfig,
    noise: float,
    together: int,
    executor: str | Executor | None,
) -> list[InversionResult]:
    """Every prompt of ``states`` inverted, in chunks of ``together`` on ``executor``, in order; ``noise`` (relative,
    seeded by ``config.seed + 1``) added to the states first. A progress bar counts positions if ``config.progress``."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    ties = {t: tuple(x for x in g if x != t) for g in tied_token_groups(model) for t in g}
    clean = list(states.states)
    observed = [add_noise(c, noise, generator) if noise > 0 else c for c in clean]
    chunks = [slice(first, first + together) for first in range(0, len(observed), together)]
    tasks = [(observed[c], clean[c] if noise > 0 else None) for c in chunks]
    disable = None if config.progress else True
    bar = tqdm(total=sum(states.lengths), desc="inverting", unit="tok", disable=disable, leave=False)
    live = [0]  # positions reported since the last finished chunk (only where the chunks run in this process)

    def on_position(prompt: int, position: int, result: PositionResult) -> None:
        live[0] += 1
        bar.update(1)

    runner = get_executor(executor)
    fn = _InvertChunk(layer, config, ties, on_position)
    results: list[list[InversionResult]] = [[] for _ in chunks]
    try:
        for index, chunk_results in runner.map_with(ModelSetup.of(model), fn, tasks):
            results[index] = chunk_results
            bar.update(sum(len(r.token_ids) for r in chunk_results) - live[0])
            live[0] = 0
    finally:
        bar.close()
    return [r for chunk_results in results for r in chunk_results]


def _with_notes(
    model: LoadedModel, states: HiddenStates, found: tuple[str, ...], flat: list[InversionResult]
) -> list[InversionResult]:
    """The results with the notes every one carries (``found``, from :func:`_layer`) first; for states from elsewhere
    (no weights hash), each one's BOS note (:func:`_bos_note`) last."""
    if states.weights_hash is None:  # a capture from elsewhere: whether it began with BOS is not known beforehand
        return [replace(r, notes=(*found, *r.notes, *_bos_note(model, r))) for r in flat]
    return [replace(r, notes=found + r.notes) for r in flat] if found else flat


def _bos_note(model: LoadedModel, result: InversionResult) -> tuple[str, ...]:
    """What position 0 turned out to be, where the tokenizer has a BOS token (nothing about it is assumed: position 0
    is searched over the whole vocabulary like any other, so captures with and without BOS both invert); nothing where
    position 0 itself is uncertain."""
    bos = getattr(model.tokenizer, "bos_token_id", None)
    if bos is None or not result.token_ids or result.verdicts[0] == UNCERTAIN:
        return ()
    if result.token_ids[0] == bos:
        return (f"position 0 is the BOS token {model.decode([bos])!r} (the capture included special tokens)",)
    return (f"position 0 is not the BOS token {model.decode([bos])!r} (captured without it; nothing assumed)",)


def check_options(
    method: str = "sipit",
    policy: str = "linear",
    noise: float = 0.0,
    max_seconds: float | None = None,
    together: int = 32,
    batch_scale: int | None = None,
    tolerance_scale: float = 1.0,
    max_candidates: int | None = None,
    source: str | ErrorModel | None = None,
) -> None:
    """One-line errors for :func:`invert`'s options (each named as the function and the command spell it), before
    anything is loaded or computed; ``lminvert invert`` calls it before it loads the model."""
    if method not in METHODS:
        raise LminvertError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    if policy not in POLICIES:
        raise LminvertError(f"unknown policy '{policy}': use one of {', '.join(POLICIES)}")
    if noise < 0 or noise != noise:
        raise LminvertError("noise (--noise) must be a non-negative number (a relative level, e.g. 0.001)")
    if max_seconds is not None and not max_seconds > 0:
        raise LminvertError("max_seconds (--max-seconds) must be a positive number of seconds")
    if together < 1:
        raise LminvertError("together (--together) must be at least 1 (prompts inverted at once)")
    if batch_scale is not None and batch_scale < 1:
        raise LminvertError("batch_scale must be at least 1 (candidate batches relative to a CPU's)")
    if not tolerance_scale > 0:
        raise LminvertError("tolerance_scale (--tolerance-scale) must be positive (1 = the measured radii)")
    if max_candidates is not None and max_candidates < 1:
        raise LminvertError("max_candidates (--max-candidates) must be at least 1")
    if source is not None:
        if noise > 0:
            raise LminvertError(
                "give either noise (--noise: added here, and modelled) or source (--source: what the states carry), "
                "not both"
            )
        if isinstance(source, str):
            parse_source(source)  # a bad name fails here


def _invert_rows(
    model: LoadedModel,
    states: HiddenStates,
    layer: LayerSpec | None,
    leak: str,
    source: ErrorModel,
    check: bool,
    screen: bool | None,
    offsets: list[int] | None = None,
) -> list[InversionResult]:
    """A leak searched in its rows' space (:func:`.leaks.invert_leak`) at the layer asked for or found."""
    if leak == "states":
        resolved, notes = _layer(model, states, layer, source, check)
    else:
        resolved, notes = view_layer(model, states, layer, leak), states.notes
    return invert_leak(model, states, resolved, notes, leak, source, screen, offsets)


def _layer(
    model: LoadedModel, states: HiddenStates, layer: LayerSpec | None, source: ErrorModel, check: bool
) -> tuple[Layer, tuple[str, ...]]:
    """The layer to search (see :func:`invert`'s ``layer`` and ``check``) and the notes every result carries."""
    resolved = check_compatible(states, model, layer)
    notes = states.notes
    if states.layer is None and (check or resolved is None):
        resolved, fit = resolve_layer(model, list(states.states), resolved, source)
        log.info("layer fit: %s", fit.describe())
        if layer is None:
            notes += (f"layer {resolved.name} found from the states: {fit.describe()}",)
    if resolved is None:
        raise LminvertError("the states do not say which layer they hold: pass --layer")
    return resolved, notes


def _source(states: HiddenStates, source: str | ErrorModel | None, noise: float) -> ErrorModel:
    """The error model of ``states`` (see :func:`invert`)."""
    if noise > 0:  # added to these states here: nothing else differs from what they were
        own = states.weights_hash is not None
        return Noise(sigma=noise, elsewhere=not own)
    if isinstance(source, ErrorModel):
        return source
    if source is not None:
        return parse_source(source)
    return Exact() if states.weights_hash is not None else Float()


@dataclass(frozen=True)
class _InvertChunk:
    """Up to ``together`` prompts inverted at once, wherever the executor runs them (``on_position`` is a
    progress callback into this process: dropped when the task is sent to another one)."""

    layer: Layer
    config: InvertConfig
    ties: dict[int, tuple[int, ...]]
    on_position: Callable[[int, int, PositionResult], None] | None = field(default=None, compare=False)

    def __call__(
        self, model: LoadedModel, task: tuple[list[torch.Tensor], list[torch.Tensor] | None]
    ) -> list[InversionResult]:
        observed, clean = task
        return invert_prompts(
            model, observed, self.layer, self.config, clean_states=clean, on_position=self.on_position, ties=self.ties
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "on_position": None}


__all__ = [
    "POLICIES",
    "SOURCES",
    "ErrorModel",
    "GradientPolicy",
    "InversionResult",
    "InvertConfig",
    "LinearPolicy",
    "Policy",
    "PositionResult",
    "RandomPolicy",
    "SweepPolicy",
    "check_leak",
    "check_options",
    "invert",
    "invert_prompt",
    "invert_prompts",
    "parse_source",
]
