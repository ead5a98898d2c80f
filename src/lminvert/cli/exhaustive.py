"""`lminvert exhaustive`: append every vocabulary token to a prefix and compare all continuations' states.

For each prefix, its KV cache is built once and all |V| one-token continuations run in batches over it; at
each layer the exact minimum distance among the |V|(|V|-1)/2 continuation pairs (1.2e9 for SmolLM2's 49,152
tokens) is found with the same exact blocked search as `lminvert collisions`. Resumable; writes
results.json, results.md and nn_distances.png to --out.
"""

from __future__ import annotations

import argparse

from ..collisions import exhaustive_test, prefixes_from_collisions
from ..errors import LminvertError
from ..models import DEFAULT_LAYERS
from ..paths import check_output_dir
from .common import (
    add_command,
    add_model_args,
    add_search_args,
    executor_from_args,
    model_from_args,
    search_settings,
)
from .runs import report_run

EXAMPLES = """A prefix run to the top layer takes |V| one-token forwards over its cache: 72 s for SmolLM2 on 2 idle CPU
cores (317 s while sharing them with another job), plus 10-22 s of search per layer.

examples:
  lminvert exhaustive --prefix "The capital of France is" --layers 1,15,30 --out runs/ex1
  lminvert exhaustive --from-collisions runs/c2k --prefixes 3 --out runs/ex-closest
  lminvert exhaustive --model tiny-llama --prefix "hello" --prefix "def f(x):" --layers all --out runs/tiny
  lminvert exhaustive --prefix "The capital of France is" --layers all --ray auto --out runs/ex-cluster
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "exhaustive",
        "compare all one-token continuations of a prefix (the exhaustive injectivity test)",
        __doc__,
        EXAMPLES,
    )
    add_model_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prefix", action="append", help="a prefix text (repeat for several)")
    source.add_argument("--from-collisions", metavar="DIR", help="take prefixes from a collisions run's closest pairs")
    parser.add_argument("--prefixes", type=int, default=1, help="with --from-collisions: how many prefixes")
    parser.add_argument(
        "--layers", default=DEFAULT_LAYERS, help="'all' or a comma-separated list (default: first, middle, last block)"
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="continuations per forward")
    add_search_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prefixes < 1:
        raise LminvertError("--prefixes must be at least 1")
    if args.batch_size < 1:
        raise LminvertError("--batch-size must be positive")
    settings = search_settings(args)
    prefixes = args.prefix if args.prefix else prefixes_from_collisions(args.from_collisions, args.prefixes)
    check_output_dir(args.out)
    model = model_from_args(args)
    results = exhaustive_test(
        model,
        prefixes,
        layers=args.layers,
        out=args.out,
        threshold=settings.threshold,
        k=settings.k,
        tile_rows=settings.tile_rows,
        tile_cols=settings.tile_cols,
        block_pairs=settings.block_pairs,
        batch_size=args.batch_size,
        executor=executor_from_args(args),
    )
    return report_run(results, args)
