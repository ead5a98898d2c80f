"""How well each source of the proposal places the true token before anything is verified: the next-token prior, the
reading (the preparation's network where one is cached, else the linear map: what ``lminvert invert`` reads with),
the two merged place by place, and the two fused as a product of experts with each ``--fused`` weight (``fitted``: the
weight lminvert fits for the layer's reading, :mod:`lminvert.invert.fusion`, what ``lminvert invert`` ranks with).

    python benchmarks/bench_first_guess.py --layers 8,15,22,30 --prompts 24
    python benchmarks/bench_first_guess.py --layers 15,30 --prompts 24 --fused 0.25,0.5,1,2
    python benchmarks/bench_first_guess.py --layers 25,30 --set eval --per-kind 6 --fused 0.5,1

Held-out prompts (``heldout.DEEP``; ``--set eval``: the evaluation set's prose, code, chat and random ids,
``--per-kind`` of each, drawn from the embedded corpora with ``--seed``) of 20 tokens, positions 1-19 (position 0 is the
first-position table's), SmolLM2.
Printed per layer and source: the share of positions whose true token it ranks within its first 1, 8 and 64, and
the mean ``log2(2 + rank)`` (a rank beyond the first 2,048 counted as 4,096).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch

from heldout import DEEP

DEPTH = 2048


def _rank(order: torch.Tensor, token: int) -> int:
    found = (order == token).nonzero()
    return int(found[0, 0]) if len(found) else 2 * DEPTH


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="15,30")
    parser.add_argument("--prompts", type=int, default=len(DEEP))
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument(
        "--fused",
        default="0.25,0.5,1,2,fitted",
        help="the reading's weights in the fused source ('fitted': the layer's own, lminvert.invert.fusion)",
    )
    parser.add_argument("--set", default="deep", choices=("deep", "eval"), help="heldout.DEEP or the evaluation set")
    parser.add_argument("--per-kind", type=int, default=6, help="--set eval: prompts of each kind")
    parser.add_argument("--seed", type=int, default=0, help="--set eval: the draw")
    args = parser.parse_args()

    import lminvert
    from lminvert.forward import prompt_states
    from lminvert.invert.fusion import fitted_weight
    from lminvert.invert.linear import FUSED
    from lminvert.invert.proposal import NextTokenPrior, merge
    from lminvert.invert.reader import load_reader, reading_for

    model = lminvert.load_model(args.model)
    if args.set == "deep":
        prompts = [list(model.tokenize(t, args.length)) for t in DEEP[: args.prompts]]
    else:
        from evalset import evaluation_prompts

        kinds = ["prose", "code", "chat", "random"]
        prompts = [list(p.ids) for p in evaluation_prompts(model, args.per_kind, args.length, args.seed, kinds=kinds)]
    for spec in args.layers.split(","):
        layer = model.probe.layer(spec)
        observed = [s[layer] for s in prompt_states(model, prompts, [layer], progress=False)]
        reading = reading_for(model, layer)
        ranks: dict[str, list[int]] = {}
        for k, given in enumerate(args.fused.split(",")):
            weight = fitted_weight(model, layer, reading, FUSED) if given == "fitted" else float(given)
            label = f"fused {weight:g}" + (" (fitted)" if given == "fitted" else "")
            prior = NextTokenPrior(model, layer, observed, depth=DEPTH, reading=reading, fused=weight)
            for i, ids in enumerate(prompts):
                for t in range(1, len(ids)):
                    orders = prior.orders(t)[i].cpu()
                    found = {label: orders[2]}
                    if k == 0:
                        found |= {"next-token": orders[0], "reading": orders[1], "merged": merge(orders[:2])}
                    for name, order in found.items():
                        ranks.setdefault(name, []).append(_rank(order, ids[t]))
        kind = "network" if load_reader(model, layer) is not None else "linear map"
        print(f"layer {layer.name} ({kind}), {len(prompts)} prompts, {len(ranks['merged'])} positions:")
        for name, values in ranks.items():
            n = len(values)
            shares = "  ".join(f"first {k} {sum(r < k for r in values) / n:.3f}" for k in (1, 8, 64))
            mean = sum(math.log2(2 + r) for r in values) / n
            print(f"  {name:>20}: {shares}  mean log2(2 + rank) {mean:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
