"""One vector (``--leak last``): how often the whole prompt comes back from its last position's state alone, by
layer, length and kind of prompt (SmolLM2 by default, this machine).

Prompts of exactly ``--lengths`` tokens of each of ``--kinds`` (:func:`lminvert.experiments.prompts.evaluation_prompts`:
prose and code sampled from the bundled corpora, random token ids; the search's only knobs are its budgets), each
encoded by lminvert at each of ``--layers``; the last position's state (unit length with ``--normalised``) is given
to ``lminvert.invert(..., leak="last")`` with ``max_seconds`` per vector. Printed per cell: exact prompts, token
accuracy (recovered tokens equal to the prompt's at the same position, over the prompt's length; ``end``: positions
counted from the end, as the audit aligns a last leak), verdicts, wrong prompts claimed ``certified`` or
``confident`` (must be 0), median and slowest seconds. The anchors the issue names (SODA 79.5% of short prompts exact
from logits; Rep2Text about half the tokens of 16-token prompts) are published figures on other models, not measured
here.

    python benchmarks/bench_last.py --layers 1,15,30,final --lengths 1,2,4,8 --per-kind 3 --seconds 30
    python benchmarks/bench_last.py --layers 15 --lengths 2,4 --per-kind 3 --seconds 30 --normalised
    python benchmarks/bench_last.py --layers 1,15,30,final --lengths 1,2,8 --max-length 2 --capture right

``--capture right`` (or ``left``): the vectors from one padded batch, as a deployment computes them, which no forward
reproduces bit for bit, so a right prompt is ``confident`` at best (:mod:`lminvert.invert.wholegap`) and this measures
that rule's false-confident rate (the ``wrong`` column).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lminvert
from lminvert.experiments.prompts import evaluation_prompts
from lminvert.invert.layouts import padded_states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--layers", default="1,15,30,final")
    parser.add_argument("--lengths", default="1,2,4,8")
    parser.add_argument("--kinds", default="prose,code,random")
    parser.add_argument("--per-kind", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="each vector's budget (max_seconds)")
    parser.add_argument("--max-length", type=int, default=None, help="the longest prompt tried (default 8)")
    parser.add_argument("--normalised", action="store_true", help="give unit vectors, as embedding APIs return them")
    parser.add_argument(
        "--capture", choices=("own", "right", "left"), default="own",
        help="own: lminvert's forward of the prompt alone; right/left: the cell's prompts and a longer one in one "
        "padded batch (as a deployment computes them: not bit for bit lminvert's), given as source float",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    model = lminvert.load_model(args.model, dtype=args.dtype)
    kinds = args.kinds.split(",")
    print(f"{'layer':>6} {'len':>4} {'kind':>7} {'exact':>6} {'tokens':>7} {'end':>5} {'cert':>5} {'conf':>5} "
          f"{'unc':>5} {'wrong':>5} {'median s':>9} {'max s':>7}")  # fmt: skip
    for name in args.layers.split(","):
        layer = model.probe.layer(name if name == "final" else int(name))
        for length in [int(n) for n in args.lengths.split(",")]:
            prompts = evaluation_prompts(model, args.per_kind, length, seed=args.seed, kinds=kinds)
            for kind in kinds:
                _cell(model, layer, length, kind, [p.ids for p in prompts if p.kind == kind], args)
    print(f"device: {model.probe.device} ({model.dtype}); torch {torch.__version__}, {torch.get_num_threads()} threads")


def _cell(model, layer, length: int, kind: str, prompts: list, args: argparse.Namespace) -> None:
    exact = tokens = ends = certified = confident = uncertain = wrong = 0
    seconds = []
    prompts = [list(ids) for ids in prompts]
    vectors = [lminvert.encode(model, [ids], layer).states[0][-1].float() for ids in prompts]
    if args.capture != "own":  # a longer prompt in the batch pads every one of the cell's
        partner = torch.randint(0, model.probe.vocab_size, (length + 3,), generator=torch.Generator().manual_seed(0))
        batch = padded_states(model.probe, layer, [*prompts, partner.tolist()], args.capture)
        vectors = [rows[-1].float() for rows in batch[: len(prompts)]]
    source = "float" if args.normalised or args.capture != "own" else None
    for ids, vector in zip(prompts, vectors, strict=True):
        if args.normalised:
            vector = vector / vector.norm()
        start = time.perf_counter()
        (result,) = lminvert.invert(
            model, vector, layer, leak="last", normalised=args.normalised, max_seconds=args.seconds,
            max_length=args.max_length, source=source,
        )  # fmt: skip
        seconds.append(time.perf_counter() - start)
        right = result.token_ids == ids
        exact += right
        tokens += sum(a == b for a, b in zip(result.token_ids, ids, strict=False))
        ends += sum(a == b for a, b in zip(result.token_ids[::-1], ids[::-1], strict=False))
        sure = result.verdicts[0] != "uncertain" if result.verdicts else False
        certified += result.verdicts.count("certified") == len(result.verdicts) and bool(result.verdicts)
        confident += result.verdicts.count("confident") == len(result.verdicts) and bool(result.verdicts)
        uncertain += not sure
        wrong += sure and not right
    n = len(prompts)
    print(
        f"{layer.name:>6} {length:>4} {kind:>7} {exact:>3}/{n:<2} {tokens / (n * length):>7.2f} "
        f"{ends / (n * length):>5.2f} {certified:>5} {confident:>5} {uncertain:>5} {wrong:>5} "
        f"{statistics.median(seconds):>9.2f} {max(seconds):>7.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
