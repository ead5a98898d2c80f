"""A speed switch measured in one process: each held-out prompt inverted with a named switch on and off in turn (the
order alternating from prompt to prompt), the tokens and verdicts of the two compared, the medians and their ratio
printed.

A switch is ``module:NAME``, a module's boolean constant (every speed mechanism has one, e.g.
``lminvert.models.vocabulary:HALF_RANKS``, ``lminvert.invert.rows.rankers:VIEW_PRIOR``); with ``--values A,B``, a
setting of another type (an int or a float: ``lminvert.invert.acceptor:PACE --values 8,4``), A in the "on" columns.
The leak is lminvert's own states (``--leak states``, as ``lminvert encode`` writes them, searched by the engine) or a
KV cache as transformers returns it (``--leak kv``: ``past_key_values.layers[LAYER - 1]``, through
``lminvert.invert(..., leak="kv")``), or ``hidden_states[LAYER]`` under a defence (``--source noise:0.01``,
``quant:int8``: through ``source=``).
Untimed first: one inversion of the first prompt's first 4 tokens each way (tables, calibrations and maps built or
read).

    python benchmarks/bench_switch.py --switch lminvert.models.vocabulary:HALF_RANKS --model gemma3-270m --layer 18
    python benchmarks/bench_switch.py --switch lminvert.invert.rows.rankers:VIEW_PRIOR --leak kv --layer 30

Exit status 1 where the two differ in a token or a verdict, or a wrong token is claimed certified or confident.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

import lminvert
from bench_leaks import _capture
from heldout import DEEP, FRESH, HELD_OUT
from lminvert.states import HiddenStates

CLAIMED = ("certified", "confident")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", required=True, help="module:NAME, a boolean constant")
    parser.add_argument("--values", default=None, help="A,B: the two values of a setting that is not a boolean")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--leak", choices=("states", "kv"), default="states")
    parser.add_argument("--layer", type=int, default=30, help="the states' layer, or the KV cache's block")
    parser.add_argument("--prompts", type=int, default=12, help="held-out texts, in order (heldout.py)")
    parser.add_argument("--set", choices=("all", "fresh"), default="all", help="HELD_OUT, DEEP, FRESH; or FRESH alone")
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument(
        "--source",
        default=None,
        help="a defence on a states leak, as bench_leaks.py applies it (noise:0.01, quant:int8)",
    )
    args = parser.parse_args()
    if args.source and args.leak != "states":
        parser.error("--source defends a states leak: drop it or --leak kv")
    where, _, name = args.switch.partition(":")
    try:
        module = importlib.import_module(where)
    except ImportError:
        parser.error(f"no module {where!r}: give --switch as module:NAME, e.g. lminvert.models.vocabulary:HALF_RANKS")
    current = getattr(module, name, None)
    if args.values is None and not isinstance(current, bool):
        parser.error(f"{args.switch} is not a boolean constant: give --switch as module:NAME, or --values A,B")
    values = {True: True, False: False}
    if args.values is not None:
        if isinstance(current, bool) or not isinstance(current, int | float):
            parser.error(f"--values sets an int or a float constant; {args.switch} is {current!r}")
        try:
            a, b = (type(current)(value) for value in args.values.split(","))
        except ValueError:
            parser.error(f"--values takes two {type(current).__name__}s, A,B (e.g. 8,4), not {args.values!r}")
        values = {True: a, False: b}
    model = lminvert.load_model(args.model, dtype=args.dtype)
    texts = list(FRESH if args.set == "fresh" else dict.fromkeys((*HELD_OUT, *DEEP, *FRESH)))[: args.prompts]
    prompts = [list(model.tokenize(text, args.length)) for text in texts]

    def run(ids: list[int], on: bool) -> tuple[lminvert.InversionResult, float]:
        setattr(module, name, values[on])
        if args.leak == "kv" or args.source:
            leak = HiddenStates.from_array(_capture(model, ids, args.leak, args.layer, args.source, 0))
        else:
            leak = lminvert.encode(model, [ids], args.layer)
        start = time.perf_counter()
        result = lminvert.invert(model, leak, args.layer, leak=args.leak, source=args.source)[0]  # None: own, exact
        return result, time.perf_counter() - start

    for on in (True, False):
        run(prompts[0][:4], on)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    same = wrong = exact = 0
    print(f"{'prompt':>6} {'on s':>6} {'off s':>6} {'on cand':>8} {'off cand':>8} exact same")
    for i, ids in enumerate(prompts):
        results = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            results[on], took = run(ids, on)
            seconds[on].append(took)
        a, b = results[True], results[False]
        agree = a.token_ids == b.token_ids and a.verdicts == b.verdicts
        same += agree
        exact += a.token_ids == ids
        wrong += sum(
            v in CLAIMED and t != truth
            for r in (a, b)
            for t, truth, v in zip(r.token_ids, ids, r.verdicts, strict=True)
        )
        print(
            f"{i:>6} {seconds[True][-1]:>6.2f} {seconds[False][-1]:>6.2f} {sum(a.candidates_checked):>8} "
            f"{sum(b.candidates_checked):>8} {a.token_ids == ids!s:>5} {agree!s:>4}",
            flush=True,
        )
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    label = f"{args.switch} {values[True]} / {values[False]}" if args.values else f"{args.switch} on / off"
    print(
        f"{label}: median {on:.3f} / {off:.3f} s (ratio {on / off:.3f}), mean "
        f"{statistics.mean(seconds[True]):.3f} / {statistics.mean(seconds[False]):.3f} s; exact {exact}/{len(prompts)}"
        f"; same tokens and verdicts {same}/{len(prompts)}; wrong claimed {wrong}"
    )
    under = f" under {args.source}" if args.source else ""
    print(f"{args.model} ({args.dtype}), {args.leak} at {args.layer}{under}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    return 0 if same == len(prompts) and wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
