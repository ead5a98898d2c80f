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
from ..errors import LminvertError
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

EXAMPLES = """corpora (--corpus):
  code       the Python standard library's own sources (offline, every Python has them)
  prose      English prose shipped with lminvert (King James Bible narrative books, public domain)
  mixed      half code, half prose
  FILE       .txt (one document) or .jsonl (a "text" field per line), or a directory of .txt/.md/.py files
  hf:NAME    a Hugging Face dataset (needs `pip install 'lminvert[datasets]'` and network), e.g.
             hf:wikimedia/wikipedia:20231101.en

examples:
  lminvert collisions --corpus mixed --n-prompts 2000 --layers 1,middle,-1 --out runs/c2k
  lminvert collisions --model gpt2-small-random --corpus code --n-prompts 20000 --max-tokens 16 --out runs/gpt2
  lminvert collisions --corpus notes.jsonl --n-prompts 500 --out runs/mine --json
  lminvert collisions --n-prompts 100000 --ray auto --out runs/c100k   # on a running Ray cluster
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "collisions", "exact minimum distances between prompts' hidden states, per layer", __doc__, EXAMPLES
    )
    add_model_args(parser)
    parser.add_argument(
        "--corpus", default="mixed", help="code, prose, records, mixed, a file or directory, or hf:NAME"
    )
    parser.add_argument("--n-prompts", type=int, default=1000, help="number of distinct prompts N")
    parser.add_argument("--layers", default="all", help="'all' (1..L) or a comma-separated list, e.g. 1,middle,-1")
    parser.add_argument("--max-tokens", type=int, default=32, help="prompt length K: windows of K tokens")
    parser.add_argument("--min-tokens", type=int, default=None, help="drop windows shorter than this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt sampling")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per encoding forward")
    add_search_args(parser)
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.n_prompts < 2:
        raise LminvertError("--n-prompts must be at least 2")
    if args.max_tokens < 1:
        raise LminvertError("--max-tokens must be at least 1")
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        raise LminvertError("--min-tokens must lie between 1 and --max-tokens")
    if args.batch_tokens < 1:
        raise LminvertError("--batch-tokens must be positive")


def run(args: argparse.Namespace) -> int:
    _check(args)
    settings = search_settings(args)
    check_output_dir(args.out)
    model = model_from_args(args)
    results = find_collisions(
        model,
        corpus=args.corpus,
        n_prompts=args.n_prompts,
        layers=args.layers,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        out=args.out,
        threshold=settings.threshold,
        k=settings.k,
        seed=settings.seed,
        tile_rows=settings.tile_rows,
        tile_cols=settings.tile_cols,
        block_pairs=settings.block_pairs,
        batch_tokens=args.batch_tokens,
        executor=executor_from_args(args),
    )
    return report_run(results, args)
