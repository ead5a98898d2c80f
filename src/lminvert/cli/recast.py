"""How `lminvert invert` reads half-precision states or KV caches that a float32 model may have computed and a user cast
to half precision to save (the file's dtype does not say which, and neither ``--dtype`` nor ``--source`` was given).

Where the layer (a KV cache's block) is known before the search (for states, at worst the layer they fit best) and the
float32 model's first-position table there is kept, position 0 says it first (:func:`cast_first`): rows that the half
model's own table does not reproduce bit for bit (a half model's rows are reproduced on this CPU: SmolLM2 layers 1, 15
and final, every coordinate), but the float32 table rounded does (:mod:`lminvert.invert.casts`), are read by the float32
model as the cast they are (``--source quant:bf16|fp16``), once. Else, where rows read as a half model's leave half or
more of a prompt's positions ``uncertain`` and every prompt's position-0 row says it is a float32 computation rounded,
the file is read again that way (:func:`reread`). Each result says so; where the rows do not say so, a hint names that
reading."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import torch

from ..invert import Leak, Run, Search, invert
from ..invert.casts import AGREE, is_cast
from ..invert.layerfit import fit_layers
from ..invert.tables import table_path
from ..invert.views import make_view
from ..kv_captures import KVCapture
from ..models import LoadedModel
from ..models.compat import CASTS
from ..states import HiddenStates
from .common import model_from_args


def _mostly_uncertain(result) -> bool:
    return result.source == "float" and 2 * len(result.uncertain_positions) >= len(result.token_ids) > 0


def cast_first(
    args: argparse.Namespace, model: LoadedModel, name: str, states: HiddenStates | KVCapture, layer, leak: Leak
) -> tuple[LoadedModel, Leak, Any, str | None]:
    """The model, leak and layer to read ``states`` with, and the note each result then carries: the float32 model,
    ``quant:bf16|fp16`` and the layer checked where :func:`told_cast` says so; else ``model``, ``leak`` and
    ``layer`` as they are, and None."""
    if leak.kind not in ("states", "kv"):
        return model, leak, layer, None
    told = told_cast(args, model, name, states, layer)
    if told is None:
        return model, leak, layer, None
    full, note, at = told
    return full, replace(leak, source=f"quant:{CASTS[states.dtype or '']}"), at, note


def told_cast(
    args: argparse.Namespace, model: LoadedModel, name: str, states: HiddenStates | KVCapture, layer
) -> tuple[LoadedModel, str, Any] | None:
    """The float32 model, the note that says so and the layer checked, where half-precision ``states`` read by the
    half ``model`` are a float32 computation cast before the search: neither ``--dtype`` nor ``--source`` given, the
    layer known (``layer``, else the one the states record or a KV cache's block, else the layer that states fit best,
    :func:`lminvert.invert.layerfit.fit_layers`), the half model's table not reproducing position 0,
    the float32 model's table there kept already (the float32 model is loaded only then: a capture of another
    machine's half kernels is not reproduced either), and that table saying so (see the module docstring); else
    None."""
    cast = CASTS.get(states.dtype or "")
    if cast is None or model.dtype != states.dtype or args.dtype or getattr(args, "source", None):
        return None
    kv = isinstance(states, KVCapture)
    known = layer if layer is not None else (states.block if kv else states.layer)
    if known is None and not kv and _finite(states.states, model.probe.hidden_size):
        fit = fit_layers(model, list(states.states))  # a few milliseconds; the search fits again as it does
        known = fit.best if fit.fits else None
    if known is None:
        return None  # a KV block found by the search: the second reading serves (reread)
    dtype, at = getattr(torch, states.dtype), model.probe.layer(known)
    if _position_0(model, states, at, dtype):
        return None  # the half model's own rows
    table_layer = make_view("kv", model, at).states_layer if kv else at
    if not table_path(model, table_layer, "table", dtype="float32").is_file():
        return None  # no float32 model loaded, no table built before the search: the second reading serves
    full = model_from_args(args, name, dtype="float32")
    if not _position_0(full, states, full.probe.layer(known), dtype):
        return None
    what = "KV cache" if kv else "states"
    found = "" if layer is not None or (states.block if kv else states.layer) is not None else f" at layer {known}"
    note = (
        f"every prompt's position-0 row is a float32 computation of its token{found} rounded to {states.dtype} (at "
        f"least {AGREE:.0%} of its coordinates bit for bit), not a {states.dtype} model's: read as a float32 "
        f"model's {what} cast to {states.dtype} (--dtype float32 --source quant:{cast}; --source float reads them as "
        f"a {states.dtype} model's)"
    )
    return full, note, full.probe.layer(known)


def _finite(rows, width: int) -> bool:
    """Every prompt holds rows of ``width`` numbers, all finite (else the search's checks refuse them in one line)."""
    return all(len(r) and r.shape[-1] == width and bool(torch.isfinite(r).all()) for r in rows)


def _position_0(model: LoadedModel, states: HiddenStates | KVCapture, layer, dtype: torch.dtype) -> bool:
    """Whether ``model``'s first-position table, rounded to ``dtype``, reproduces every prompt's position-0 row
    (:func:`lminvert.invert.casts.is_cast`; a KV cache's through the view at each prompt's offset); False for rows of
    another width or not finite (the search refuses them in one line)."""
    kv = isinstance(states, KVCapture)
    view = make_view("kv", model, layer) if kv else None
    if not _finite(states.rows if kv else states.states, view.width if view is not None else model.probe.hidden_size):
        return False
    rows = [r[0] for r in (states.rows if kv else states.states)]
    return is_cast(model, rows, layer, dtype, view, list(states.offsets) if kv else None)


def reread(
    args: argparse.Namespace, model: LoadedModel, name: str, states: HiddenStates | KVCapture, leak: Leak,
    search: Search, run: Run, results: list,
) -> tuple[LoadedModel, list]:  # fmt: skip
    """The model and results to report: ``results`` as they are, or, where the rows are a float32 computation cast
    (none of ``--dtype`` and ``--source`` given: the user said nothing of how they were computed), the float32
    model's reading of the whole file under ``quant:bf16|fp16`` (each prompt's seconds those of both readings)."""
    cast = CASTS.get(states.dtype or "")
    if cast is None or model.dtype != states.dtype or leak.kind not in ("states", "kv") or args.dtype or args.source:
        return model, results
    if not any(_mostly_uncertain(r) for r in results):
        return model, results
    full = model_from_args(args, name, dtype="float32")
    layer = full.probe.layer(results[0].layer)  # a KV cache's: its block
    what = "KV cache" if isinstance(states, KVCapture) else "states"
    if not _position_0(full, states, layer, getattr(torch, states.dtype)):
        return model, results  # the hint names that reading (cast_hint)
    again = invert(full, states, layer, leak=replace(leak, source=f"quant:{cast}"), search=search, run=run)
    note = (
        f"read as a {states.dtype} model's {what}, {sum(len(r.uncertain_positions) for r in results)} of "
        f"{sum(len(r.token_ids) for r in results)} positions were uncertain; every prompt's position-0 row is a "
        f"float32 computation of its token rounded to {states.dtype} (at least {AGREE:.0%} of its coordinates bit for "
        f"bit): read again as a float32 model's {what} cast to {states.dtype} (--dtype float32 --source "
        f"quant:{cast}); the seconds count both readings"
    )
    return full, [
        replace(r, seconds=r.seconds + first.seconds, notes=(*r.notes, note))
        for r, first in zip(again, results, strict=True)
    ]


def cast_hint(model: LoadedModel, dtype: str | None, results: list, kind: str = "states") -> None:
    """Where half-precision states or KV rows (``kind``) read as computed in that precision (``float`` source, the
    model in the file's dtype) leave half or more of a prompt's positions uncertain, name the other reading a user may
    mean: a float32 model's rows cast to half precision to be saved (``--dtype float32 --source quant:bf16|fp16``).
    One vector (``last``) is uncertain wherever its prompt is not found, cast or not: the hint says only that."""
    cast = CASTS.get(dtype or "")
    worst = max(results, key=lambda r: len(r.uncertain_positions) / max(len(r.token_ids), 1), default=None)
    if cast is None or model.dtype != dtype or worst is None or not _mostly_uncertain(worst):
        return
    if kind == "last":
        said, them, they = f"no prompt was found for the vector read as a {dtype} model's", "it", "it was"
    else:
        what = "KV cache" if kind == "kv" else "states"
        counts = f"{len(worst.uncertain_positions)} of {len(worst.token_ids)}"
        said, them, they = f"{counts} positions are uncertain read as a {dtype} model's {what}", "them", "they were"
    print(
        f"hint: {said}; if a float32 model computed {them} and {they} saved in {dtype}, try --dtype float32 "
        f"--source quant:{cast}",
        file=sys.stderr,
    )
