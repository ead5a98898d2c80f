"""`lminvert collisions`: search a corpus's prompts for pairs with (near-)identical hidden states, per layer.

Encodes N distinct prompts, takes each one's last-token state at every requested layer and finds, per layer,
the exact minimum L2 distance over all N(N-1)/2 pairs (float32 GEMM, rigorous error bound, float64
re-measurement), the k closest pairs, the pairs under the collision threshold and the nearest-neighbour
distribution. Writes results.json, results.md and nn_distances.png to --out; rerun the same command to
resume an interrupted run.
"""

from __future__ import annotations

import argparse

from ..collisions import find_collisions
from ..collisions.search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS
from ..errors import LminvertError
from ..models import load_model
from .common import Formatter, add_model_args, print_json

EXAMPLES = """corpora (--corpus):
  code       the Python standard library's own sources (offline, every Python has them)
  prose      English prose shipped with lminvert (King James Bible narrative books, public domain)
  mixed      half code, half prose
  FILE       .txt (one document) or .jsonl (a "text" field per line), or a directory of .txt/.md/.py files
  hf:NAME    a Hugging Face dataset (needs `pip install 'lminvert[datasets]'` and network), e.g.
             hf:wikimedia/wikipedia:20231101.en

examples:
  lminvert collisions --corpus mixed --n-prompts 2000 --layers 1,15,30 --out runs/c2k
  lminvert collisions --model gpt2-small-random --corpus code --n-prompts 20000 --layers all --max-tokens 16 \\
      --threshold 1e-6 --k 10 --seed 1 --out runs/gpt2
  lminvert collisions --corpus notes.jsonl --n-prompts 500 --out runs/mine --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "collisions",
        help="exact minimum distances between prompts' hidden states, per layer",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_model_args(parser)
    parser.add_argument("--corpus", default="mixed", help="code, prose, mixed, a file or directory, or hf:NAME")
    parser.add_argument("--n-prompts", type=int, default=1000, help="number of distinct prompts N")
    parser.add_argument("--layers", default="all", help="'all' (1..L) or a comma-separated list, e.g. 1,15,30")
    parser.add_argument("--max-tokens", type=int, default=32, help="prompt length K: windows of K tokens")
    parser.add_argument("--min-tokens", type=int, default=None, help="drop windows shorter than this")
    parser.add_argument("--threshold", type=float, default=1e-6, help="a pair closer than this is a collision")
    parser.add_argument("--k", type=int, default=10, help="closest pairs to report per layer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt sampling")
    parser.add_argument("--tile-rows", type=int, default=DEFAULT_TILE_ROWS, help="rows per GEMM tile")
    parser.add_argument("--tile-cols", type=int, default=DEFAULT_TILE_COLS, help="columns per GEMM tile")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per encoding forward")
    parser.add_argument("--executor", default="inprocess", help="inprocess, ray or ray://host:port (layer searches)")
    parser.add_argument("--no-figure", action="store_true", help="skip the matplotlib figure")
    parser.add_argument("--out", required=True, help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json instead of the table")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.n_prompts < 2:
        raise LminvertError("--n-prompts must be at least 2")
    if args.max_tokens < 1:
        raise LminvertError("--max-tokens must be at least 1")
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        raise LminvertError("--min-tokens must lie between 1 and --max-tokens")
    if args.k < 1:
        raise LminvertError("--k must be at least 1")
    if not args.threshold >= 0:
        raise LminvertError("--threshold must be a non-negative number")
    if args.tile_rows < 1 or args.tile_cols < 1 or args.batch_tokens < 1:
        raise LminvertError("--tile-rows, --tile-cols and --batch-tokens must be positive")


def run(args: argparse.Namespace) -> int:
    _check(args)
    model = load_model(args.model, dtype=args.dtype)
    results = find_collisions(
        model,
        corpus=args.corpus,
        n_prompts=args.n_prompts,
        layers=args.layers,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        out=args.out,
        threshold=args.threshold,
        k=args.k,
        seed=args.seed,
        tile_rows=args.tile_rows,
        tile_cols=args.tile_cols,
        batch_tokens=args.batch_tokens,
        executor=args.executor,
        figure=not args.no_figure,
    )
    if args.json:
        print_json(results.to_dict())
        return 0
    from ..collisions.results import layer_table

    print(
        f"{results.model}: {results.n_prompts} prompts, {results.n_pairs:,} pairs per layer, "
        f"corpus {results.config.corpus}"
    )
    print("\n".join(layer_table(results.layers, results.config.threshold, results.config.k)))
    collisions = sum(r.n_below_threshold for r in results.layers.values())
    print(
        f"{collisions} collision(s) under {results.config.threshold:g}; {results.pairs_per_second:.3g} pairs/s, "
        f"{results.matmul_fraction:.0%} of this machine's float32 matmul"
    )
    print(f"wrote {', '.join(results.paths.values())}")
    return 0
