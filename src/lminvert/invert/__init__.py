"""Exact prompt inversion from hidden states (SIPIT) and its baselines."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy
import torch
from tqdm.auto import tqdm

from ..errors import LminvertError
from ..executors import Executor, ModelSetup, get_executor
from ..kv_captures import KVCapture, read_kv
from ..models import Layer, LayerSpec, LoadedModel
from ..models.compat import CASTS, check_compatible
from ..models.loading import require_loaded
from ..models.probe import has_hooks
from ..models.ties import tied_twins
from ..paths import clock, clock_offset
from ..states import HiddenStates
from . import leaks
from .acceptor import UNCERTAIN
from .engine import InvertConfig, invert_prompt, invert_prompts
from .last import LastOptions
from .layerchoice import resolve_layer
from .leaks import DEFENDED, block_number, invert_leak, kv_states, sink_prompts, sink_retry, view_layer
from .options import METHODS, Leak, Run, Search, check_rows_options, grouped
from .policies import POLICIES, GradientPolicy, LinearPolicy, Policy, RandomPolicy, SweepPolicy
from .results import InversionResult, PositionResult
from .sources import SOURCES, ErrorModel, Exact, Float, Noise, default_source, parse_source
from .tolerance import add_noise

log = logging.getLogger(__name__)


def invert(
    model: LoadedModel,
    states: HiddenStates | torch.Tensor | numpy.ndarray | list[torch.Tensor] | KVCapture,
    layer: LayerSpec | None = None,
    *,
    leak: Leak | str | None = None,
    search: Search | None = None,
    run: Run | None = None,
    **options: Any,
) -> list[InversionResult]:
    """Recover the token ids of every prompt in ``states`` (one result per prompt, in order): :class:`HiddenStates`, a
    tensor or numpy array ``[d]``, ``[T, d]`` or ``[N, T, d]``, a list of ``[T, d]`` tensors, or a :class:`KVCapture`.

    ``model`` comes from :func:`lminvert.load_model`, in the dtype the states were computed in (checked against the
    file; warned of where a float32 model meets half-precision numbers); it runs on its device. ``layer`` (a KV
    cache's block) defaults to what the states file says (and must agree with it), else is found from the states
    (:mod:`lminvert.invert.layerfit`), and the result's notes say so.

    The options come in the three groups of ``lminvert invert --help``, named as its options
    (:mod:`lminvert.invert.options`): ``leak`` (:class:`Leak`: ``kind``, ``source``, ``noise``, ``check``; or just the
    kind, ``leak="kv"``), ``search`` (:class:`Search`: ``method``, ``policy``, ``max_candidates``, ``max_seconds``,
    ``tolerance_scale``, ``certify``, ``screen``, ``speculate``, ``scout``, ``first_table``, ``seed``) and ``run``
    (:class:`Run`: ``together``, ``executor``, ``batch_scale``, ``progress``). Any field may be given by name instead
    of its group (``invert(model, states, max_seconds=30)``); each group's docstring says what its fields do.

    What the leak is decides the search. lminvert's own states (source ``exact``, what :func:`lminvert.encode` writes)
    and float states from elsewhere (``float``, a bare array's default) are searched by the engine
    (:mod:`lminvert.invert.engine`): up to ``together`` prompts at once, one batched forward per verification step, on
    ``executor``'s workers in chunks. A KV cache (``kind="kv"``: block ``layer``'s keys after the rotary embedding
    then values, ``[T, 2 * kv_heads * head_dim]`` per prompt, as :func:`lminvert.kv_captures.read_kv` reads a saved
    cache; block ``b`` is transformers' ``cache.layers[b - 1]``; a :class:`lminvert.KVCapture` is one) and states whose
    ``source`` is ``noise:S`` or ``quant:B`` are searched in the rows' own space with the leak's error model
    (:mod:`lminvert.invert.rows`: the first token and ambiguous positions chosen by the next rows; ``max_seconds``
    only of the engine's options). One vector (``kind="last"``: a bare ``[d]`` or ``[N, d]`` array's rows, a states
    file's last rows) is searched for whole prompts of up to ``max_length`` tokens, ``max_seconds`` each.

    Every position's verdict is the acceptor's (:mod:`lminvert.invert.acceptor`), with the error model of ``source``;
    no option of ``search`` or ``run`` changes what it accepts. ``max_seconds`` counts from this call, one-time builds
    not counted (:func:`lminvert.paths.clock`): after it, every position stops after its first batch and keeps the
    closest candidate verified (the notes say so)."""
    leak, search, run = grouped(leak, search, run, **options)
    deadline = None if search.max_seconds is None else clock() + search.max_seconds
    states, layer, kind, offsets = _given(model, states, layer, leak, search, run)
    model = require_loaded(model, "invert")
    _check_screen(model, search.screen, search.scout)
    error_model = _source(states, leak.source, leak.noise)
    _warn_half_values(model, states, error_model, kind)
    if kind != "states" or (leak.noise == 0 and error_model.name in DEFENDED):  # noise added here: the engine's
        check_rows_options(leak, search, run, defended=error_model.label if kind == "states" else None)  # known now
        last = _last_options(leak, search)
        return _invert_rows(model, states, layer, kind, error_model, leak.check, search.screen, offsets, last, deadline)
    resolved, found = _layer(model, states, layer, error_model, leak.check)
    config = _config(model, search, run, error_model, deadline)
    sinks = sink_prompts(model, states, resolved, error_model) if leak.noise == 0 else []
    bounded = leaks.bounded(model, sinks)
    flat = _invert_chunks(model, states, resolved, config, leak.noise, run.together, run.executor, bounded)
    if sinks:  # a capture whose guess lies at a later sink: the next row chooses there, then the engine goes on
        resume = functools.partial(_resume, model, states, resolved, config, leak.noise, run.executor, bounded)
        flat = sink_retry(model, states, resolved, error_model, flat, search.screen, deadline, resume)
    return _with_notes(model, states, found, flat)


def _warn_half_values(model: LoadedModel, states: HiddenStates, error_model: ErrorModel, kind: str) -> None:
    """Warn, before the search, where a float32 model is to read states (``kind``) whose every value is a half number
    (:meth:`HiddenStates.half_values`: a half model's states saved wider, as numpy saves them) as a float32
    computation's (``exact``, ``float``): no candidate is likely to fit. (``lminvert invert`` loads the half model
    instead, with a note.)"""
    read = kind == "states" and model.dtype == "float32" and error_model.name in ("exact", "float")
    half = states.half_values() if read else None
    if half is not None:
        log.warning(
            "every value of these states is a %s number: a %s model's states saved in a wider dtype? load the model "
            "with dtype='%s' (or, for a float32 model's states cast to %s, pass source='quant:%s')",
            half, half, half, half, CASTS[half],
        )  # fmt: skip


def _resume(
    model: LoadedModel, states: HiddenStates, layer: Layer, config: InvertConfig, noise: float,
    executor: str | Executor | None, bounded: Sequence[int], index: int, known: Sequence[int],
) -> InversionResult:  # fmt: skip
    """Prompt ``index`` inverted by the engine again from its first tokens ``known`` on, bounded as it was at first
    (:attr:`.engine.InvertConfig.known`, :func:`.leaks.bounded`)."""
    again = replace(config, known=tuple(int(t) for t in known))
    alone = [0] if index in bounded else []
    return _invert_chunks(model, _subset(states, [index]), layer, again, noise, 1, executor, alone)[0]


def _given(
    model: LoadedModel, states: Any, layer: LayerSpec | None, leak: Leak, search: Search, run: Run
) -> tuple[HiddenStates, LayerSpec | None, str, list[int] | None]:
    """What ``invert`` was given as rows, its layer (a KV cache's block), the leak's kind and a KV cache's left
    padding: a :class:`KVCapture`'s rows and block, a cache still in memory with ``leak="kv"`` (``out.past_key_values``,
    a list of (keys, values): :func:`lminvert.read_kv` of block ``layer``), else :func:`_as_states`."""
    kind, offsets = leak.kind, None
    if kind == "kv" and not isinstance(states, KVCapture) and not _array_like(states):
        states = read_kv(states, block=block_number(layer))
    if isinstance(states, KVCapture):
        states, layer, kind, offsets = kv_states(model, states, layer, kind, leak.check)
        check_rows_options(replace(leak, kind=kind), search, run)
    return _as_states(states), layer, kind, offsets


def _array_like(states: Any) -> bool:
    """Whether :func:`_as_states` reads ``states`` as states: :class:`HiddenStates`, a tensor, a numpy array, or a
    non-empty list or tuple of tensors."""
    if isinstance(states, HiddenStates | torch.Tensor | numpy.ndarray):
        return True
    return isinstance(states, list | tuple) and bool(states) and all(isinstance(s, torch.Tensor) for s in states)


def _as_states(states: Any) -> HiddenStates:
    """``states`` as :class:`HiddenStates`: a tensor or numpy array (``[d]``, ``[T, d]`` or ``[N, T, d]``) or a list of
    ``[T, d]`` tensors read as :meth:`HiddenStates.from_array` reads them; a one-line error for anything else."""
    if isinstance(states, HiddenStates):
        return states
    if isinstance(states, torch.Tensor):
        return HiddenStates.from_array(states.detach().cpu())
    if isinstance(states, numpy.ndarray):
        return HiddenStates.from_array(states)
    if _array_like(states):  # a non-empty list of tensors
        return HiddenStates.from_array([s.detach().cpu() for s in states])
    raise LminvertError(
        "invert takes hidden states (HiddenStates.load(path), a tensor or numpy array [T, d], a list of [T, d] "
        f"tensors) or a KV cache (lminvert.read_kv(path)), not {type(states).__name__}"
    )


def _last_options(leak: Leak, search: Search) -> LastOptions:
    """One vector's search options (:mod:`.last`) of a call's: ``max_length``, and ``max_seconds`` per vector."""
    return LastOptions(
        max_length=search.max_length or LastOptions.max_length,
        normalised=leak.normalised,
        seconds=search.max_seconds or LastOptions.seconds,
    )


def _config(model: LoadedModel, search: Search, run: Run, source: ErrorModel, deadline: float | None) -> InvertConfig:
    """The engine's configuration of a call's search and run options."""
    return InvertConfig(
        method=search.method,
        certify=_certify(model, search.certify),
        policy=search.policy,
        first_table=search.first_table,
        max_candidates=search.max_candidates,
        deadline=deadline,
        tolerance_scale=search.tolerance_scale,
        source=source,
        seed=search.seed,
        progress=run.progress,
        batch_scale=run.batch_scale,
        speculate=search.speculate,
        screen=search.screen,
        scout=search.scout,
    )


def _check_screen(model: LoadedModel, screen: bool | None, scout: bool | None = None) -> None:
    """A one-line error where ``screen=True`` or ``scout=True`` was asked of a model whose linear layers cannot run in
    bfloat16 (see :func:`invert`)."""
    reason = model.probe.screen_refusal
    if screen and reason is not None:
        raise LminvertError(
            f"screening runs a float32 model's candidate batches in bfloat16; {reason}: drop --screen (screen=True)"
        )
    if scout and reason is not None:
        raise LminvertError(
            f"the scout runs a float32 model's forwards in bfloat16; {reason}: drop --scout (scout=True)"
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
    bounded: Sequence[int] = (),
) -> list[InversionResult]:
    """Every prompt of ``states`` inverted, in chunks of ``together`` on ``executor``, in order; ``noise`` (relative,
    seeded by ``config.seed + 1``) added to the states first; prompts ``bounded`` each alone, within
    :data:`.leaks.SINK_SECONDS` of its start and to its first guess (:func:`.leaks.sink_prompts`,
    :data:`.leaks.GUESS_ENDS`). A progress bar counts positions if
    ``config.progress``."""
    if bounded:
        rest = [i for i in range(len(states.states)) if i not in bounded]
        got = _invert_chunks(model, _subset(states, rest), layer, config, noise, together, executor) if rest else []
        out = dict(zip(rest, got, strict=True))
        for i in bounded:
            bound = clock() + leaks.SINK_SECONDS
            deadline = bound if config.deadline is None else min(config.deadline, bound)
            alone = replace(config, deadline=deadline, guess_ends=leaks.GUESS_ENDS)
            out[i] = _invert_chunks(model, _subset(states, [i]), layer, alone, noise, 1, executor)[0]
        return [out[i] for i in range(len(states.states))]
    generator = torch.Generator().manual_seed(config.seed + 1)
    ties = tied_twins(model)
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


def _subset(states: HiddenStates, index: Sequence[int]) -> HiddenStates:
    """Prompts ``index`` of ``states``, in that order."""
    return states.with_meta(states=tuple(states.states[i] for i in index))


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


def _invert_rows(
    model: LoadedModel,
    states: HiddenStates,
    layer: LayerSpec | None,
    leak: str,
    source: ErrorModel,
    check: bool,
    screen: bool | None,
    offsets: list[int] | None = None,
    last: LastOptions | None = None,
    deadline: float | None = None,
) -> list[InversionResult]:
    """A leak searched in its rows' space, or one vector's (:func:`.leaks.invert_leak`) at the layer asked for or
    found; after ``deadline`` (:func:`lminvert.paths.clock`), each position stops after its first batch."""
    if leak == "states":
        resolved, notes = _layer(model, states, layer, source, check)
    else:
        resolved, notes = view_layer(model, states, layer, leak, source)
    return invert_leak(model, states, resolved, notes, leak, source, screen, offsets, last, deadline)


def _layer(
    model: LoadedModel, states: HiddenStates, layer: LayerSpec | None, source: ErrorModel, check: bool
) -> tuple[Layer, tuple[str, ...]]:
    """The layer to search (see :func:`invert`'s ``layer`` and ``check``) and the notes every result carries."""
    resolved = check_compatible(states, model, layer, source.stored)
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
    return default_source(states)


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

    def __getstate__(self) -> dict[str, Any]:  # the bound sent as a wall-clock time, read on the worker's clock
        return {**self.__dict__, "on_position": None, "config": self.config.moved(clock_offset())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "config": state["config"].moved(-clock_offset())})


__all__ = [
    "METHODS",
    "POLICIES",
    "SOURCES",
    "ErrorModel",
    "Exact",
    "Float",
    "GradientPolicy",
    "InversionResult",
    "InvertConfig",
    "Leak",
    "LinearPolicy",
    "Policy",
    "PositionResult",
    "RandomPolicy",
    "Run",
    "Search",
    "SweepPolicy",
    "grouped",
    "invert",
    "invert_prompt",
    "invert_prompts",
    "parse_source",
]
