"""What :func:`lminvert.invert` does with a leak other than lminvert's own or foreign float states (a KV cache, one
vector, states under a ``noise:``/``quant:`` source): its layer (a KV cache's block), and the
rows search on its view (:mod:`.rows.route`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..errors import LminvertError
from ..kv_captures import KVCapture
from ..models import Layer, LayerSpec, LoadedModel
from ..models.compat import check_dtype
from ..models.kv import kv_block, sliding_window
from ..paths import past
from ..states import HiddenStates
from .acceptor import UNCERTAIN
from .blockfit import refuse_other_block, resolve_block
from .engine import bound_source
from .last import LastOptions, invert_last
from .results import KNOWN, InversionResult
from .rows.route import invert_rows
from .sources import ErrorModel
from .views import make_view

DEFENDED = ("noise", "quant")  # sources whose states the rows search inverts (the engine's bound is too loose there)
# float states whose first uncertain position after position 0 is sink-like: that prompt searched again by the rows
# search (a later sink chosen by the next row, the choice replayed through the capture), the result with more positions
# sure kept (sink_retry; False: the engine's result stands)
SINK_RETRY = True
SINK_SECONDS = 30.0  # a half-precision model's engine time on such a prompt before it (a sink-like row after 0)
# ... and its search of such a prompt ends at its first guess (every later position its first batch only: after a guess
# every later one is uncertain, and the rows search takes the prompt over; False: the engine runs on to the bound)
GUESS_ENDS = True
# ... and the rows search starts at the first uncertain position, the engine's sure ones before it taken as they are
# (rows.search.RowSearch.run's known; False: it searches the prompt from position 0)
KNOWN_PREFIX = True
# ... and it searches that position and the next alone, then the engine goes on after its sure ones (a rows search
# errs at ordinary positions the engine certifies; False: the rows search searches the rest of the prompt)
HANDBACK = True
HANDOVERS = 4  # sinks a prompt hands to the rows search at most (HANDBACK)


def invert_leak(
    model: LoadedModel,
    states: HiddenStates,
    resolved: Layer,
    notes: tuple[str, ...],
    leak: str,
    source: ErrorModel,
    screen: bool | None,
    offsets: list[int] | None = None,
    last: LastOptions | None = None,
    deadline: float | None = None,
) -> list[InversionResult]:
    """``states``' rows as leak ``leak`` at layer ``resolved`` (a KV cache's block), searched in their own space
    (:mod:`lminvert.invert.rows`; after ``deadline`` (``paths.clock()``), each position stops after its first batch), or
    one vector per prompt (``last``: :mod:`.last`, with ``last``'s options); ``notes``: what every result carries
    first; one-line errors for rows of another width or dtype than the view's."""
    view = make_view(leak, model, resolved)
    if states.hidden_size != view.width:
        raise LminvertError(
            f"these rows hold {states.hidden_size} numbers each, but {leak} at layer {resolved.name} of "
            f"{model.name} has {view.width}: check --leak and --layer"
        )
    check_dtype(states.dtype, model, "rows", source.stored)
    if leak == "kv":
        notes = (*notes, *window_note(model, resolved, [len(s) for s in states.states]))
    if leak == "last":
        return invert_last(model, last_vectors(states), resolved, source, last or LastOptions(), notes)
    return invert_rows(model, list(states.states), view, source, notes, screen, offsets, deadline)


def window_note(model: LoadedModel, block: Layer, lengths: list[int]) -> list[str]:
    """A note where ``block`` attends over a sliding window and a prompt holds as many rows as transformers keeps of
    such a block's cache (its window less one, or the window): they may be a longer prompt's last positions, which
    fit no prompt counted from position 0 (every position ``uncertain``)."""
    window = sliding_window(model.probe.config, int(block))
    if window is None or not any(length in (window - 1, window) for length in lengths):
        return []
    return [
        f"block {block.name} of {model.name} attends over a sliding window of {window} positions, and transformers' "
        f"cache of such a block keeps only a prompt's last {window - 1}: if these rows are those of a longer prompt, "
        "no prompt fits them (every position uncertain); a full-attention block's cache holds every position"
    ]


def last_vectors(states: HiddenStates) -> list:
    """The vectors of a ``last`` leak: every row of a bare array of one item (``[d]`` or ``[N, d]``: N vectors), else
    each prompt's last row (a states file from ``lminvert encode``, or ``[N, T, d]``)."""
    if states.weights_hash is None and len(states.states) == 1:
        return list(states.states[0])
    return [s[-1] for s in states.states]


def block_number(layer: LayerSpec | None) -> int | None:
    """A KV cache's block as given (``layer``: an int or its digits; None: not given); a one-line error for another
    layer name ('middle', 'final'), which names no block."""
    if layer is None or (isinstance(layer, int) and not isinstance(layer, bool)):
        return layer
    if isinstance(layer, str) and layer.lstrip("-").isdigit():
        return int(layer)
    raise LminvertError(f"a KV cache's layer is its block number (1..), not {layer!r}")


def kv_states(
    model: LoadedModel, capture: KVCapture, layer: LayerSpec | None, leak: str, check: bool = True
) -> tuple[HiddenStates, LayerSpec | None, str, list[int]]:
    """A KV cache read from a file (:func:`lminvert.kv_captures.read_kv`) as rows of ``model``'s KV heads
    (:func:`kv_heads`), its block and left padding; ``check``: a block given for a file that does not say its own is
    refused where the rows rule it out (:func:`.blockfit.refuse_other_block`)."""
    if leak not in ("states", "kv"):
        raise LminvertError(f"a KV cache is the kv leak, not {leak}: drop --leak {leak}")
    layer = block_number(layer)
    if layer is not None and capture.block is not None and layer != capture.block:
        raise LminvertError(f"the file holds block {capture.block}'s cache, not block {layer}: drop --layer")
    capture = kv_heads(model, capture)
    if check and layer is not None and capture.block is None:
        refuse_other_block(model, list(capture.rows), layer)
    states = HiddenStates(states=capture.rows, dtype=capture.dtype, notes=capture.notes)
    return states, layer if layer is not None else capture.block, "kv", list(capture.offsets)


def kv_heads(model: LoadedModel, capture: KVCapture) -> KVCapture:
    """``capture`` where it holds ``model``'s KV heads; where it holds each of them repeated alike (transformers'
    ``repeat_kv``: the ``num_attention_heads`` keys and values an attention hook sees), one of each, with a note; a
    one-line error where its heads or head size are not the model's."""
    block = kv_block(model, capture.block or 1)
    heads, size, n = block.heads, block.head_dim, capture.heads // block.heads
    if (capture.heads, capture.head_dim) == (heads, size):
        return capture
    if capture.head_dim == size and capture.heads == n * heads and n > 1:
        grouped = [r.view(len(r), 2, heads, n, size) for r in capture.rows]  # repeat_kv: head h is KV head h // n
        if all(torch.equal(g, g[:, :, :, :1].expand_as(g)) for g in grouped):
            rows = tuple(g[:, :, :, 0].reshape(len(g), -1) for g in grouped)
            note = (
                f"the cache holds {capture.heads} heads: each of {model.name}'s {heads} KV heads {n} times (repeat_kv, "
                "as attention sees them); each read once"
            )
            return replace(capture, rows=rows, heads=heads, notes=(*capture.notes, note))
    raise LminvertError(
        f"this cache holds {capture.heads} heads of {capture.head_dim} numbers at each position, but {model.name}'s "
        f"blocks keep {heads} KV heads of {size}: pass the model that produced it with --model"
    )


def view_layer(
    model: LoadedModel, states: HiddenStates, layer: LayerSpec | None, leak: str, source: ErrorModel
) -> tuple[Layer, tuple[str, ...]]:
    """The layer (a KV cache's block) of a ``kv`` or ``last`` leak: given, else recorded, else (a KV cache) found from
    the rows (:mod:`.blockfit`, noted on every result); a one-line error else. With the notes every result carries."""
    spec = layer if layer is not None else states.layer
    if spec is None and leak == "kv":
        block, fit = resolve_block(model, list(states.states), source)
        return block, (*states.notes, f"block {block.name} found from the rows: {fit.describe()}")
    if spec is None:
        raise LminvertError("the rows do not say which layer they come from: pass --layer with the layer")
    return model.probe.layer(spec), states.notes


def _retries(source: ErrorModel) -> bool:
    """Whether a capture under ``source`` may be searched again (:data:`SINK_RETRY`, a ``float`` source's states)."""
    return SINK_RETRY and source.name == "float" and source.bitwise


def sink_prompts(model: LoadedModel, states: HiddenStates, layer: Layer, source: ErrorModel) -> list[int]:
    """The prompts of float ``states`` (a capture from elsewhere) with a sink-like row after position 0 (the ``float``
    model's bands, :meth:`.sources.ErrorModel.fragile`), which :func:`sink_retry` may search again (none where
    :data:`SINK_RETRY` is off or the source is not ``float``)."""
    if not _retries(source):
        return []
    bands = bound_source(model, layer, source)
    return [i for i, rows in enumerate(states.states) if any(bands.fragile(r, t) for t, r in enumerate(rows.float()))]


def bounded(model: LoadedModel, sinks: list[int]) -> list[int]:
    """Of the prompts :func:`sink_prompts` named, those the engine searches for :data:`SINK_SECONDS` at most, to its
    first guess (:data:`GUESS_ENDS`): a half-precision model's search of such a position may take many minutes (SmolLM2
    bfloat16, layer 15, docs/results.md); a float32 model's decides it (none)."""
    return [] if model.dtype == "float32" else list(sinks)


Resume = Callable[[int, Sequence[int]], InversionResult]  # (prompt, its first tokens, known) -> the engine's result


def _continued(model: LoadedModel, before: InversionResult, upto: int, after: InversionResult) -> InversionResult:
    """``after``, a search that took ``before``'s first ``upto`` tokens as known (placeholders there, reason
    :data:`.results.KNOWN`), with ``before``'s positions there; ``after`` itself where it searched from 0."""
    if not after.positions or after.positions[0].reason != KNOWN:
        return after
    positions = [*before.positions[:upto], *after.positions[upto:]]
    ids = [p.token_id for p in positions]
    return replace(after, token_ids=ids, text=model.decode(ids), positions=positions)


def _unsure(result: InversionResult) -> int:
    """The first position of ``result`` that is ``uncertain`` (its length where none is)."""
    return next((t for t, v in enumerate(result.verdicts) if v == UNCERTAIN), len(result.verdicts))


def sink_retry(
    model: LoadedModel, states: HiddenStates, layer: Layer, source: ErrorModel, results: list[InversionResult],
    screen: bool | None = None, deadline: float | None = None, resume: Resume | None = None,
) -> list[InversionResult]:  # fmt: skip
    """The engine's ``results`` for float ``states`` (a capture from elsewhere), each prompt whose first uncertain
    position after position 0 is sink-like (the ``float`` model's bands, :meth:`.sources.ErrorModel.fragile`: there
    the state's own row does not choose, and every later position follows the guess) or whose later positions the
    bound of :func:`bounded` stopped (:data:`SINK_SECONDS`, :data:`GUESS_ENDS`) searched again by the rows search from
    that position on, the engine's sure positions before it taken as they are (:data:`KNOWN_PREFIX`): its next row
    chooses at such a sink, and its replay through the capture may certify the choice (:mod:`.rows.lookahead`). With
    ``resume`` (the engine again on prompt ``i`` from its first tokens on, :data:`HANDBACK`) the rows search takes that
    position and the next alone and the engine goes on after its sure ones, up to :data:`HANDOVERS` times. Of the
    results before and after each hand-over, both the acceptor's, the one with more positions ``certified`` or
    ``confident`` (the earlier where as many), its seconds every search's. Nothing once ``deadline`` has passed."""
    if not _retries(source):
        return results
    bands, view, out = bound_source(model, layer, source), make_view("states", model, layer), []
    for index, (rows, result) in enumerate(zip(states.states, results, strict=True)):
        said: list[str] = []  # each hand-over's note, kept across them
        for _ in range(HANDOVERS if HANDBACK and resume is not None else 1):
            result, note, done = _handed(model, rows, result, (bands, view, source, screen, deadline), resume, index)
            said += [note] if note else []
            if done:
                break
        out.append(replace(result, notes=(*result.notes, *said)) if said else result)
    return out


def _handed(
    model: LoadedModel, rows: torch.Tensor, result: InversionResult, how: tuple, resume: Resume | None, index: int
) -> tuple[InversionResult, str | None, bool]:
    """One hand-over of :func:`sink_retry` (``how``: the bands, the states view, the source, screening, the deadline):
    the result kept, a note on it (None: nothing searched again) and whether to stop there."""
    bands, view, source, screen, deadline = how
    first = _unsure(result)
    if first in (0, len(rows)) or past(deadline):
        return result, None, True
    sink = bands.fragile(rows[first].float(), first)
    if not (sink or any(p.stopped for p in result.positions[first:])):
        return result, None, True
    back = HANDBACK and resume is not None and first + 2 < len(rows)
    known = result.token_ids[:first] if KNOWN_PREFIX or back else []
    until = first + 2 if back else None  # handed back: this position and the next alone
    again = invert_rows(model, [rows], view, source, (), screen, None, deadline, known, until)[0]
    seconds, again = result.seconds + again.seconds, _continued(model, result, first, again)
    sure, why = _unsure(again), "sink-like" if sink else "the engine stopped at or after it"
    note = f"position {first}: {why}; searched again in the rows' space, a later sink chosen by the next row"
    if back and first < sure and not past(deadline):  # the rows search decided it: the engine goes on after it
        tail = resume(index, again.token_ids[:sure])
        seconds, again = seconds + tail.seconds, _continued(model, again, sure, tail)
        note += f", the engine again from position {sure}"
    if len(again.positions) < len(rows):  # handed back, not decided (or out of time): nothing to keep
        return replace(result, seconds=seconds), f"{note}: not decided there, or the time bound passed", True
    counts = [sum(v != UNCERTAIN for v in r.verdicts) for r in (result, again)]
    if counts[1] <= counts[0]:
        note += f" (there {counts[1]} positions sure, {counts[0]} before: the earlier kept)"
        return replace(result, seconds=seconds), note, True
    return replace(again, seconds=seconds), note, False
