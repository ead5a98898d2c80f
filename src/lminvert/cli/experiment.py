"""`lminvert experiment`: the paper's experiments, one command each.

Each writes results.json (config, seed, versions, machine, timings, every row), results.md (the tables beside the
paper's numbers) and figures/ (PNG and SVG) into --out, and resumes from --out after an interruption: finished
units are kept. `--quick` sizes take under two minutes each on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import LminvertError
from ..experiments import EXPERIMENTS, get_experiment
from ..experiments import run as run_experiment
from ..paths import check_output_dir
from .common import add_command, add_model_args, add_ray_arg, executor_from_args, model_from_args, print_json

EXAMPLES = """examples:
  lminvert experiment --list
  lminvert experiment methods --quick --out runs/methods-quick
  lminvert experiment noise --quick --model tiny-llama --out runs/noise
  lminvert experiment splits --size per_kind=10 --size 'kinds=["prose","chat"]' --out runs/splits
  lminvert report runs/methods-quick runs/noise --out report.html
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "experiment",
        "reproduce one of the paper's experiments (methods, depth, vocabulary, splits, quantization, ...)",
        __doc__,
        EXAMPLES,
    )
    parser.add_argument("name", nargs="?", help="experiment name (see --list)")
    parser.add_argument("--list", action="store_true", help="list the experiments with their sizes and exit")
    parser.add_argument("--quick", action="store_true", help="the small size (minutes on a laptop CPU)")
    add_model_args(parser, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and models drawn")
    parser.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one size of the chosen preset, e.g. --size prompts=3 --size length=32 (JSON values)",
    )
    add_ray_arg(parser)
    parser.add_argument("--out", help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json instead of the summary")
    parser.set_defaults(func=run)


def _list() -> int:
    for name, cls in EXPERIMENTS.items():
        print(f"{name:<14} {cls.title}")
        print(f"{'':<14} models: {', '.join(cls.models)}; full size: {cls.full_duration}")
    return 0


def _sizes(items: list[str]) -> dict:
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LminvertError(f"--size takes KEY=VALUE, got '{item}'")
        try:
            sizes[key] = json.loads(value)
        except json.JSONDecodeError:
            sizes[key] = value  # a bare string, e.g. layer=middle
    return sizes


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    if not args.name:
        raise LminvertError("name an experiment (lminvert experiment --list shows them)")
    experiment = get_experiment(args.name)
    if not args.out:
        raise LminvertError("--out DIR is required: the directory the results go to (and resume from)")
    sizes = _sizes(args.size)
    out = check_output_dir(args.out)
    models = (args.model,) if args.model else None
    try:
        doc = run_experiment(
            experiment.name,
            out,
            quick=args.quick,
            models=models,
            load=lambda name: model_from_args(args, name),
            seed=args.seed,
            progress=not args.json,
            executor=executor_from_args(args),
            **sizes,
        )
    except KeyboardInterrupt:
        print(
            f"lminvert: interrupted; finished units are kept in {out}: rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    if args.json:
        print_json(doc)
        return 0
    print(f"{experiment.title}: {len(doc['rows'])} rows in {doc['seconds']:.1f} s")
    print(f"  results: {out / 'results.json'}, {out / 'results.md'}")
    figures = [f for f in doc["summary"]["figures"] if f.get("kind") != "file"]
    if figures:
        print(f"  figures: {out / 'figures'}/ ({', '.join(f['name'] for f in figures)})")
    return 0
