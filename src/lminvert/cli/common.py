"""Argument helpers shared by the subcommands: model, search settings, output checks, printing."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

import torch

from ..collisions.runner import SearchSettings
from ..collisions.search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS
from ..errors import LminvertError
from ..executors import executor_spec
from ..models import load_model
from ..models.compat import CASTS
from ..models.loading import DEVICES, DTYPES, LoadedModel
from ..models.registry import DEFAULT_MODEL
from ..states import HiddenStates, half_numbers


def add_model_args(
    parser: argparse.ArgumentParser,
    default: str | None = DEFAULT_MODEL,
    dtype: str | None = "float32",
    model_help: str | None = None,
    dtype_help: str = "precision the model runs in",
) -> None:
    """``--model``, ``--dtype`` and ``--device``: every command that loads a model takes all three."""
    parser.add_argument(
        "--model",
        default=default,
        help=model_help or "alias (see `lminvert models`), hub id, directory or .gguf",
    )
    parser.add_argument("--dtype", default=dtype, choices=list(DTYPES), help=dtype_help)
    parser.add_argument(
        "--device",
        default="auto",
        help=f"where the model runs: {DEVICES} (auto: CUDA when available, else the CPU)",
    )


def add_states_args(parser: argparse.ArgumentParser, model_help: str, dtype_help: str) -> None:
    """A states file and how to read it (`invert`, `inspect`): the file, --key, --mask, the model and its dtype."""
    parser.add_argument("states", help="states file: .safetensors (lminvert encode, or any keys), .npy, .pt/.pth")
    parser.add_argument(
        "--key",
        default=None,
        help="the entry holding the states in a file of several (name or index); in a file of one array, its slice I "
        "along the first axis (one layer of torch.stack(output_hidden_states))",
    )
    parser.add_argument(
        "--mask", default=None, help="the batch's attention mask ([N, T] of 0/1, .npy/.pt): rows it marks 0 are dropped"
    )
    add_model_args(parser, default=None, dtype=None, model_help=model_help, dtype_help=dtype_help)


def model_for_states(args: argparse.Namespace, name: str, states: HiddenStates) -> tuple[LoadedModel, HiddenStates]:
    """The model that reads ``states``: ``name``, in --dtype, else the dtype the states record, else the half dtype
    of which every value is a number (:meth:`HiddenStates.half_values`: the states then record it, with a note),
    else float32; and the states."""
    half = None if args.dtype else states.half_values()
    if half is not None:
        states = replace(states, dtype=half, notes=(*states.notes, widened_note(half)))
    return model_from_args(args, name, dtype=args.dtype or (states.dtype if states.dtype in DTYPES else None)), states


def model_for_kv(args: argparse.Namespace, capture):
    """The model that reads a KV ``capture`` (:class:`lminvert.kv_captures.KVCapture`): ``args.model`` in --dtype,
    else the dtype of which every row value is a half number (the rows then cast to it, losslessly, with a note:
    :func:`lminvert.states.half_numbers`), else the capture's dtype, else float32; and the capture."""
    half = None if args.dtype else half_numbers(capture.rows)
    if half is not None:  # a half model's rows saved wider: read as the half numbers they are
        rows = tuple(r.to(getattr(torch, half)) for r in capture.rows)
        capture = replace(capture, rows=rows, notes=(*capture.notes, widened_note(half, "KV cache")))
    return model_from_args(args, args.model, dtype=args.dtype or capture.dtype), capture


def widened_note(half: str, what: str = "states") -> str:
    """The note on rows read as a ``half`` model's, though saved in a wider dtype
    (:func:`lminvert.states.half_numbers`)."""
    return (
        f"every value is a {half} number: read as a {half} model's {what} saved in a wider dtype (--dtype float32 "
        f"--source quant:{CASTS[half]} for a float32 model's {what} cast to {half})"
    )


def model_from_args(args: argparse.Namespace, name: str | None = None, dtype: str | None = None) -> LoadedModel:
    """The CLI is the one place that turns a model name into a loaded model."""
    return load_model(name or args.model, dtype=dtype or args.dtype or "float32", device=args.device)


def add_search_args(parser: argparse.ArgumentParser) -> None:
    """Options of the exact pairwise search, shared by `collisions` and `exhaustive`."""
    parser.add_argument("--threshold", type=float, default=1e-6, help="a pair closer than this is a collision")
    parser.add_argument("--k", type=int, default=10, help="closest pairs to report per layer")
    parser.add_argument("--tile-rows", type=int, default=DEFAULT_TILE_ROWS, help="rows per GEMM tile")
    parser.add_argument("--tile-cols", type=int, default=DEFAULT_TILE_COLS, help="columns per GEMM tile")
    parser.add_argument(
        "--block-pairs",
        type=float,
        default=None,
        metavar="PAIRS",
        help="pairs per search task: a layer's rows are split into blocks of about this many pairs, searched as "
        "separate tasks and merged (the same result); 0: one task per layer (default: one per layer without "
        "--ray, blocks of up to 2e8 pairs with it)",
    )
    add_ray_arg(parser)
    parser.add_argument("--no-figure", action="store_true", help="skip the matplotlib figure")
    parser.add_argument("--out", required=True, help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json instead of the table")


def add_ray_arg(parser: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]``: run the work on Ray workers (the same results and output directory as without)."""
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on Ray (pip install 'lminvert[ray]'): no ADDRESS starts a local Ray, 'auto' joins the running "
        "cluster (ray start --head), or HOST:PORT; each worker loads the model once",
    )


def executor_from_args(args: argparse.Namespace) -> str:
    """The executor ``--ray`` names (in this process without it)."""
    return executor_spec(getattr(args, "ray", None))


def search_settings(args: argparse.Namespace) -> SearchSettings:
    """Validated search settings (a one-line error before any work if one is out of range)."""
    block = args.block_pairs
    if block is not None and not (block >= 0 and block == int(block)):
        raise LminvertError("--block-pairs must be a whole number of pairs (0: one task per layer)")
    return SearchSettings(
        args.threshold, args.k, getattr(args, "seed", 0), args.tile_rows, args.tile_cols,
        None if block is None else int(block),
    )  # fmt: skip


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default appended to its help, unless the help says it already or there is none to say (None,
    an unset flag, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == []
        if "(default:" in text or unset or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    help_text: str,
    description: str | None,
    examples: str,
    defaults: bool = True,
) -> argparse.ArgumentParser:
    """A sub-command's parser: its one-line help, its description (the module's docstring) and its examples as the
    epilog, laid out as written (``defaults``: each option's default appended to its help)."""
    formatter = Formatter if defaults else argparse.RawDescriptionHelpFormatter
    return sub.add_parser(name, help=help_text, description=description, epilog=examples, formatter_class=formatter)
