"""`lminvert invert`'s second reading of half-precision states or KV caches: where rows read as a half model's leave
half or more of a prompt's positions ``uncertain`` and every prompt's position-0 row says it is a float32 computation
rounded to that precision (:mod:`lminvert.invert.casts`), the file is read again by the float32 model as the cast it
is (``--source quant:bf16|fp16``), and each result says so; where the rows do not say so, a hint names that reading."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from ..invert import Leak, Run, Search, invert
from ..invert.casts import AGREE, is_cast
from ..invert.views import make_view
from ..kv_captures import KVCapture
from ..models import LoadedModel
from ..models.compat import CASTS
from ..states import HiddenStates
from .common import model_from_args


def _mostly_uncertain(result) -> bool:
    return result.source == "float" and 2 * len(result.uncertain_positions) >= len(result.token_ids) > 0


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
    dtype = getattr(torch, states.dtype)
    if isinstance(states, KVCapture):
        view, what = make_view("kv", full, layer), "KV cache"
        told = is_cast(full, [r[0] for r in states.rows], layer, dtype, view, list(states.offsets))
    else:
        what = "states"
        told = is_cast(full, [s[0] for s in states.states], layer, dtype)
    if not told:
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


def cast_hint(model: LoadedModel, dtype: str | None, results: list, what: str = "states") -> None:
    """Where half-precision rows read as computed in that precision (``float`` source, the model in the file's dtype)
    leave half or more of a prompt's positions uncertain, name the other reading a user may mean: a float32 model's
    rows cast to half precision to be saved (``--dtype float32 --source quant:bf16|fp16``)."""
    cast = CASTS.get(dtype or "")
    worst = max(results, key=lambda r: len(r.uncertain_positions) / max(len(r.token_ids), 1), default=None)
    if cast is None or model.dtype != dtype or worst is None or not _mostly_uncertain(worst):
        return
    print(
        f"hint: {len(worst.uncertain_positions)} of {len(worst.token_ids)} positions are uncertain read as a {dtype} "
        f"model's {what}; if a float32 model computed them and they were saved in {dtype}, try --dtype float32 "
        f"--source quant:{cast}",
        file=sys.stderr,
    )
