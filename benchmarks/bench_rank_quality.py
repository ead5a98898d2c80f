"""How well each ranker of the linear policy places the true token, per layer: the ablation table.

    python benchmarks/bench_rank_quality.py                          # SmolLM2, layers 3,9,15,21,27, 1 prompt per kind
    python benchmarks/bench_rank_quality.py --layers 15 --per-kind 2 --dtype bfloat16

Each prompt of the evaluation set (prose, code, random ids, personal data; 20 tokens) is inverted with the default
policy as it runs; at every position that reaches a ranked round (its first batch and any chain of first guesses
missed), each ranker's ranking at that round (:meth:`LinearPolicy.rankings`: after the first batch was verified and
the secant model refitted) is kept, and the recovered token's place in it is measured when the position is decided.
Positions decided by their first batch or a chain are counted apart: they never needed the rankers.
Prints per layer and ranker: the positions measured, the median and mean place (0: first; an order that does not
hold the token within its depth, 2,048 for ``next-token``, ``reading`` and the merged ``proposal``, counts it at twice
that), and the share within the top 16 and 64. A ranker added to :mod:`lminvert.invert.rankers` (listed in its
``EXTRA``) shows up here by its name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import encode
from lminvert.invert.engine import InvertConfig, invert_prompts
from lminvert.invert.linear import LinearPolicy
from lminvert.invert.rankers import rank_of


class Recording(LinearPolicy):
    """The default policy, keeping each ranker's ranking at a position's first ranked round."""

    def __init__(self) -> None:
        super().__init__()
        self.places: dict[str, list[int]] = defaultdict(list)
        self.unranked = 0  # positions (after position 0) decided without a ranked round
        self._pending: dict | None = None

    def propose(self, ctx):
        picks = super().propose(ctx)
        if ctx.rounds == 1:
            self._pending = self.rankings(ctx)
        return picks

    def accepted(self, position: int, token_id: int) -> None:
        if self._pending is not None:
            for name, ranking in self._pending.items():
                self.places[name].append(rank_of(ranking, token_id))
        elif position > 0:
            self.unranked += 1
        self._pending = None
        super().accepted(position, token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", default="3,9,15,21,27")
    parser.add_argument("--per-kind", type=int, default=1)
    parser.add_argument("--length", type=int, default=20)
    args = parser.parse_args()
    model = lminvert.load_model(args.model, dtype=args.dtype)
    prompts = evaluation_prompts(model, args.per_kind, args.length, 0)
    print(
        f"{args.model} {args.dtype}, {len(prompts)} prompts of {args.length} tokens, {torch.get_num_threads()} threads"
    )
    header = f"{'layer':>5} {'ranker':>10} {'n':>4} {'median':>7} {'mean':>8} {'top16':>6} {'top64':>6}"
    for layer in [int(x) for x in args.layers.split(",")]:
        policies = [Recording() for _ in prompts]
        states = encode(model, [list(p.ids) for p in prompts], layer)
        results = invert_prompts(model, list(states.states), layer, InvertConfig(), policies=policies)
        exact = sum(r.token_ids == list(p.ids) for r, p in zip(results, prompts, strict=True))
        places: dict[str, list[int]] = defaultdict(list)
        for policy in policies:
            for name, found in policy.places.items():
                places[name] += found
        unranked = sum(p.unranked for p in policies)
        print(f"\nlayer {layer}: {exact}/{len(prompts)} exact; {unranked} positions decided without a ranked round")
        print(header)
        for name, found in sorted(places.items(), key=lambda kv: statistics.median(kv[1])):
            top16 = sum(x < 16 for x in found) / len(found)
            top64 = sum(x < 64 for x in found) / len(found)
            print(
                f"{layer:>5} {name:>10} {len(found):>4} {statistics.median(found):>7.0f} "
                f"{statistics.fmean(found):>8.0f} {top16:>6.2f} {top64:>6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
