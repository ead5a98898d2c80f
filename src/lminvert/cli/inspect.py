"""`lminvert inspect`: what a states file or a saved KV cache holds, which layer of which model, and the command that
inverts it."""

from __future__ import annotations

import argparse
import shlex

import torch

from ..errors import LminvertError
from ..invert.layerchoice import window
from ..invert.layerfit import fit_layers, settle
from ..invert.leaks import window_note
from ..invert.sources import default_source
from ..kv_captures import is_kv_file, read_kv
from ..models.compat import CASTS, check_compatible
from ..models.kv import kv_block
from ..states import HiddenStates
from .common import add_command, add_states_args, model_for_kv, model_for_states, print_json
from .recast import told_cast

EXAMPLES = """examples:
  lminvert inspect leak.safetensors                       # a file from `lminvert encode`: what it records
  lminvert inspect leak.npy --model smollm2-135m          # a capture: the layer found, pads, BOS, the command
  lminvert inspect cache.pt --key hidden_states.15 --model smollm2-135m --json
  lminvert inspect kv.pt --model smollm2-135m --layer 15  # a KV cache: blocks, heads, pads, the command
"""

BOS_MATCH = 1e-3  # position 0 within this relative distance of the BOS token's own state is called BOS: a token's
# first-position state differs from another's by 4e-3 of its norm at the least at SmolLM2's sink layers, 7e-2 elsewhere


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "inspect", "states file -> shape, layer, pads, BOS", __doc__, EXAMPLES)
    add_states_args(
        parser,
        model_help="model to score the states against (default: the file's)",
        dtype_help="precision (default: the file's, else float32)",
    )
    parser.add_argument(
        "--layer",
        default=None,
        help="a KV cache's block (1..L: transformers' cache.layers[B-1]) in a whole cache (default: its lowest)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if is_kv_file(args.states):
        return _kv(args)
    states = HiddenStates.load(args.states, key=args.key, mask=args.mask)
    doc: dict = {
        "file": args.states,
        "prompts": len(states),
        "rows": states.lengths,
        "hidden_size": states.hidden_size,
        "array_dtype": str(states.states[0].dtype).replace("torch.", ""),
        "recorded": {k: v for k, v in (("model", states.model), ("layer", states.layer), ("dtype", states.dtype)) if v},
        "notes": list(states.notes),
    }
    name = args.model or states.model
    if name:
        model, states = model_for_states(args, name, states)
        doc["notes"] = list(states.notes)
        check_compatible(states, model, None)
        doc |= _against(model, states)
        found = doc["layer"]["fits"] and doc["layer"]["decisive"]
        layer = doc["layer"]["best"] if found else "L"
        command = ["lminvert", "invert", args.states, "--model", name]
        if states.layer is None:
            command += ["--layer", layer]
        told = told_cast(args, model, name, states, doc["layer"]["best"] if doc["layer"]["fits"] else None)
        if told is not None:  # as invert reads it
            doc["notes"].append(told[1])
            command += ["--dtype", "float32", "--source", f"quant:{CASTS[states.dtype or '']}"]
        command += [f"--{k}={v}" for k, v in (("key", args.key), ("mask", args.mask)) if v]
        doc["command"] = shlex.join(command)
    if args.json:
        print_json(doc)
        return 0
    _print(doc)
    return 0


def _against(model, states: HiddenStates) -> dict:
    rows = list(states.states)
    source = default_source(states)
    fit = settle(model, rows, fit_layers(model, rows), source)
    out: dict = {
        "model": model.name,
        "layer": {
            "best": fit.best,
            "fits": fit.fits,
            "decisive": fit.decisive,
            "describe": fit.describe(),
            "after_final_norm": fit.best == "final",
        },
    }
    if not (fit.fits and fit.decisive) and (text := window(model, rows, source, None)):
        out["window"] = text
    bos = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer is not None else None
    if bos is not None and fit.fits:
        layer = model.probe.layer(fit.best)
        alone = model.probe.states(torch.tensor([[bos]]), [layer])[layer][0, 0].float().cpu()
        rel = [float((s[0].float() - alone).norm() / alone.norm()) for s in states.states]
        out["bos"] = {"token_id": int(bos), "position0_distance": rel, "is_bos": [r <= BOS_MATCH for r in rel]}
    return out


def _print(doc: dict) -> None:
    rows = doc["rows"]
    print(
        f"{doc['file']}: {doc['prompts']} prompt(s), rows {rows if len(rows) <= 8 else [*rows[:8], '...']}, "
        f"d = {doc['hidden_size']}, {doc['array_dtype']}"
    )
    if doc["recorded"]:
        print("  recorded: " + ", ".join(f"{k} {v}" for k, v in doc["recorded"].items()))
    for note in doc["notes"]:
        print(f"  note: {note}")
    if "layer" not in doc:
        print("  pass --model M to find the layer, the BOS and the command that inverts it")
        return
    layer = doc["layer"]
    verdict = "fits" if layer["fits"] else "fits NO layer of this model"
    decisive = "" if layer["decisive"] else " (not decisive: give --layer)"
    print(f"  {doc['model']}: {layer['describe']}: {verdict}{decisive}")
    if "window" in doc:
        print(f"  {doc['window']}")
    if layer["after_final_norm"]:
        print("  these are states after the final norm (transformers' last hidden_states): layer final")
    if "bos" in doc:
        flags = doc["bos"]["is_bos"]
        print(f"  position 0 is the BOS token (id {doc['bos']['token_id']}) in {sum(flags)} of {len(flags)} prompt(s)")
    if layer["fits"] and "window" not in doc:
        print(f"  invert with: {doc['command']}")


def _kv(args: argparse.Namespace) -> int:
    """A saved KV cache: what it holds, checked against the model's block where one is given, and the command."""
    block = None if args.layer is None else int(args.layer)
    capture = read_kv(args.states, block=block, key=args.key, mask=args.mask)  # a whole cache: its lowest block
    doc: dict = {
        "file": args.states, "leak": "kv", "block": capture.block, "blocks": capture.blocks,
        "kv_heads": capture.heads, "head_dim": capture.head_dim, "prompts": len(capture.rows),
        "rows": [len(r) for r in capture.rows], "offsets": list(capture.offsets),
        "array_dtype": str(capture.rows[0].dtype).replace("torch.", ""), "notes": list(capture.notes),
    }  # fmt: skip
    if args.model:
        model, capture = model_for_kv(args, capture)
        doc["notes"], doc["dtype"] = list(capture.notes), str(model.probe.dtype).replace("torch.", "")
        _found_block(model, capture, doc)
        if doc["block"] is not None:
            width = kv_block(model, doc["block"]).width
            doc["fits_model"] = width == capture.rows[0].shape[1]
            doc["notes"] += window_note(model, model.probe.layer(doc["block"]), [len(r) for r in capture.rows])
            command = ["lminvert", "invert", args.states, "--model", args.model, "--layer", str(doc["block"])]
            told = told_cast(args, model, args.model, capture, doc["block"]) if doc["fits_model"] else None
            if told is not None:  # as invert reads it
                doc["notes"].append(told[1])
                command += ["--dtype", "float32", "--source", f"quant:{CASTS[capture.dtype]}"]
            command += [f"--{k}={v}" for k, v in (("key", args.key), ("mask", args.mask)) if v]
            doc["command"] = shlex.join(command)
    if args.json:
        print_json(doc)
        return 0
    of = f" of {doc['blocks']}" if doc["blocks"] else ""
    print(
        f"{doc['file']}: a KV cache, block {doc['block'] or '?'}{of}, {doc['kv_heads']} KV heads x "
        f"{doc['head_dim']}, {doc['prompts']} prompt(s), rows {doc['rows']}, {doc['array_dtype']}"
    )
    for line in doc["notes"]:
        print(f"  note: {line}")
    if "fits_model" in doc:
        print(f"  {'fits' if doc['fits_model'] else 'does NOT fit'} {args.model}'s block {doc['block']}")
        print(f"  invert with: {doc['command']}")
    return 0


def _found_block(model, capture, doc: dict) -> None:
    """A cache of one block that does not say which: the block found from its rows (:mod:`lminvert.invert.blockfit`)
    goes into ``doc`` with a note, or a note that says why none could be named."""
    if capture.block is not None:
        return
    from ..invert.blockfit import resolve_block
    from ..invert.sources import Float

    width, held = kv_block(model, 1).width, capture.rows[0].shape[1]
    if held != width:
        doc["notes"].append(f"its rows hold {held} numbers, {model.name}'s KV cache rows {width}: another model's?")
        return
    try:
        found, fit = resolve_block(model, list(capture.rows), Float())
    except LminvertError as err:
        doc["notes"].append(str(err))
        return
    doc["block"] = int(found)
    doc["notes"].append(f"block {found.name} found from the rows: {fit.describe()}")
