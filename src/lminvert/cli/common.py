"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..models.registry import DEFAULT_MODEL


def add_model_args(parser: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL) -> None:
    parser.add_argument(
        "--model",
        default=default,
        help=f"alias (see `lminvert models`), hub id, directory or .gguf (default: {default})",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def parse_layers(text: str, n_layers: int) -> list[str]:
    """'all' -> every layer 1..L; else a comma-separated list (validated later by the probe)."""
    if text.strip().lower() == "all":
        return [str(i) for i in range(1, n_layers + 1)]
    return [part.strip() for part in text.split(",") if part.strip()]


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass
