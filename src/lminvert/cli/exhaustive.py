"""`lminvert exhaustive`: append every vocabulary token to a prefix and compare all continuations' states.

For each prefix, its KV cache is built once and all |V| one-token continuations run in batches over it; at
each layer the exact minimum distance among the |V|(|V|-1)/2 continuation pairs (1.2e9 for SmolLM2's 49,152
tokens) is found with the same exact blocked search as `lminvert collisions`. Resumable; writes
results.json, results.md and nn_distances.png to --out.
"""

from __future__ import annotations

import argparse

from ..collisions import exhaustive_test
from ..collisions.exhaustive import prefixes_from_collisions
from ..errors import LminvertError
from ..models import load_model
from .common import Formatter, add_model_args, print_json

EXAMPLES = """examples:
  lminvert exhaustive --prefix "The capital of France is" --layers 1,15,30 --out runs/ex1
  lminvert exhaustive --from-collisions runs/c2k --prefixes 3 --out runs/ex-closest
  lminvert exhaustive --model tiny-llama --prefix "hello" --prefix "def f(x):" --layers all --out runs/tiny

A prefix run to the top layer takes |V| one-token forwards over its cache: 72 s for SmolLM2 on 2 idle CPU cores
(317 s while sharing them with another job), plus 10-22 s of search per layer.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "exhaustive",
        help="compare all one-token continuations of a prefix (the exhaustive injectivity test)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_model_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prefix", action="append", help="a prefix text (repeat for several)")
    source.add_argument("--from-collisions", metavar="DIR", help="take prefixes from a collisions run's closest pairs")
    parser.add_argument("--prefixes", type=int, default=1, help="with --from-collisions: how many prefixes")
    parser.add_argument("--layers", default="1,15,30", help="'all' or a comma-separated list")
    parser.add_argument("--threshold", type=float, default=1e-6, help="a pair closer than this is a collision")
    parser.add_argument("--k", type=int, default=10, help="closest pairs to report per layer")
    parser.add_argument("--batch-size", type=int, default=1024, help="continuations per forward")
    parser.add_argument("--executor", default="inprocess", help="inprocess, ray or ray://host:port")
    parser.add_argument("--no-figure", action="store_true", help="skip the matplotlib figure")
    parser.add_argument("--out", required=True, help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prefixes < 1:
        raise LminvertError("--prefixes must be at least 1")
    if args.batch_size < 1 or args.k < 1 or not args.threshold >= 0:
        raise LminvertError("--batch-size and --k must be positive and --threshold non-negative")
    prefixes = args.prefix if args.prefix else prefixes_from_collisions(args.from_collisions, args.prefixes)
    model = load_model(args.model, dtype=args.dtype)
    results = exhaustive_test(
        model,
        prefixes,
        layers=args.layers,
        out=args.out,
        threshold=args.threshold,
        k=args.k,
        batch_size=args.batch_size,
        executor=args.executor,
        figure=not args.no_figure,
    )
    if args.json:
        print_json(results.to_dict())
        return 0
    print(
        f"{results.model}: {len(results.prefixes)} prefix(es) x {results.vocab_size} continuations, "
        f"{results.n_pairs:,} pairs per prefix and layer"
    )
    for name, row in results.layers.items():
        print(
            f"  layer {name:>5}: min distance {row['min_distance']:.6g}, "
            f"{row['n_below_threshold']} pair(s) under {results.config.threshold:g}"
        )
    print(f"{results.pairs_per_second:.3g} pairs/s, {results.matmul_fraction:.0%} of this machine's float32 matmul")
    print(f"wrote {', '.join(results.paths.values())}")
    return 0
