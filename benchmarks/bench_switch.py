"""A speed switch measured in one process: each held-out prompt inverted with a named switch on and off in turn (the
order alternating from prompt to prompt), the tokens and verdicts of the two compared, the medians and their ratio
printed.

A switch is ``module:NAME``, a module's boolean constant (every speed mechanism has one, e.g.
``lminvert.models.vocabulary:HALF_RANKS``, ``lminvert.invert.rows.rankers:VIEW_PRIOR``); with ``--values A,B``, a
setting of another type (an int or a float: ``lminvert.invert.acceptor:PACE --values 8,4``), A in the "on" columns.
The leak is lminvert's own states (``--leak states``, as ``lminvert encode`` writes them, searched by the engine) or a
KV cache as transformers returns it (``--leak kv``: ``past_key_values.layers[LAYER - 1]``, through
``lminvert.invert(..., leak="kv")``), or ``hidden_states[LAYER]`` under a defence (``--source noise:0.01``,
``quant:int8``: through ``source=``), or a capture from a padded transformers batch (``--padded right`` or ``left``:
the seven prompts of ``bench_foreign.py --seed SEED``, each row as ``--source float`` takes it; ``--only 4,5``: some).
Several ``--switch`` options are switched together.
Untimed first: one inversion of the first prompt's first 4 tokens each way (tables, calibrations and maps built or
read).

    python benchmarks/bench_switch.py --switch lminvert.models.vocabulary:HALF_RANKS --model gemma3-270m --layer 18
    python benchmarks/bench_switch.py --switch lminvert.invert.rows.rankers:VIEW_PRIOR --leak kv --layer 30
    python benchmarks/bench_switch.py --switch lminvert.invert.sinks:SHAPE_ELSEWHERE \
        --switch lminvert.invert.acceptor:REPRODUCED_RIVALS --dtype bfloat16 --padded right --seed 13

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
from bench_foreign import _prompts
from bench_leaks import _capture
from heldout import DEEP, FRESH, HELD_OUT
from lminvert.invert.layouts import padded_states
from lminvert.states import HiddenStates

CLAIMED = ("certified", "confident")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", required=True, action="append", help="module:NAME, a boolean constant (repeat)")
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
    parser.add_argument("--padded", choices=("right", "left"), default=None, help="a padded batch's capture")
    parser.add_argument("--seed", type=int, default=0, help="bench_foreign.py's sample (with --padded)")
    parser.add_argument("--only", default=None, help="i,j,...: those prompts of the sample alone (with --padded)")
    args = parser.parse_args()
    if args.source and args.leak != "states":
        parser.error("--source defends a states leak: drop it or --leak kv")
    if args.padded and (args.source or args.leak != "states"):
        parser.error("--padded captures states as --source float takes them: drop --source and --leak")
    if args.values is not None and len(args.switch) > 1:
        parser.error("--values sets one switch: give one --switch")
    switches = [_switch(parser, switch, args.values) for switch in args.switch]
    model = lminvert.load_model(args.model, dtype=args.dtype)
    captures: list[torch.Tensor] = []
    if args.padded:
        prompts = [list(p.ids) for p in _prompts(model, 7, args.length, args.seed)]
        captures = padded_states(model.probe, model.probe.layer(args.layer), prompts, args.padded)
        only = (args.only or "").split(",")
        keep = range(len(prompts)) if args.only is None else [int(i) if i.isdigit() else -1 for i in only]
        if any(not 0 <= i < len(prompts) for i in keep):
            parser.error(f"--only takes indices 0-{len(prompts) - 1} of the sample, not {args.only!r}")
        prompts, captures = [prompts[i] for i in keep], [captures[i] for i in keep]
    else:
        texts = list(FRESH if args.set == "fresh" else dict.fromkeys((*HELD_OUT, *DEEP, *FRESH)))[: args.prompts]
        prompts = [list(model.tokenize(text, args.length)) for text in texts]
    source = "float" if args.padded else args.source

    def run(ids: list[int], on: bool) -> tuple[lminvert.InversionResult, float]:
        for module, name, values in switches:
            setattr(module, name, values[on])
        if captures:  # a prompt of the sample, or the first one's first tokens (their rows are their own capture)
            leak = HiddenStates.from_array(
                [captures[0][: len(ids)] if ids not in prompts else captures[prompts.index(ids)]]
            )
        elif args.leak == "kv" or args.source:
            leak = HiddenStates.from_array(_capture(model, ids, args.leak, args.layer, args.source, 0))
        else:
            leak = lminvert.encode(model, [ids], args.layer)
        start = time.perf_counter()
        result = lminvert.invert(model, leak, args.layer, leak=args.leak, source=source)[0]  # None: own, exact
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
    names = " + ".join(args.switch)
    label = f"{names} {switches[0][2][True]} / {switches[0][2][False]}" if args.values else f"{names} on / off"
    print(
        f"{label}: median {on:.3f} / {off:.3f} s (ratio {on / off:.3f}), mean "
        f"{statistics.mean(seconds[True]):.3f} / {statistics.mean(seconds[False]):.3f} s; exact {exact}/{len(prompts)}"
        f"; same tokens and verdicts {same}/{len(prompts)}; wrong claimed {wrong}"
    )
    under = f" ({args.padded}-padded, seed {args.seed})" if args.padded else ""
    under = f" under {args.source}" if args.source else under
    print(f"{args.model} ({args.dtype}), {args.leak} at {args.layer}{under}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    return 0 if same == len(prompts) and wrong == 0 else 1


def _switch(parser: argparse.ArgumentParser, switch: str, given: str | None) -> tuple:
    """``switch`` (``module:NAME``) as (module, name, {True: the "on" value, False: the "off" one})."""
    where, _, name = switch.partition(":")
    try:
        module = importlib.import_module(where)
    except ImportError:
        parser.error(f"no module {where!r}: give --switch as module:NAME, e.g. lminvert.models.vocabulary:HALF_RANKS")
    current = getattr(module, name, None)
    if given is None and not isinstance(current, bool):
        parser.error(f"{switch} is not a boolean constant: give --switch as module:NAME, or --values A,B")
    if given is None:
        return module, name, {True: True, False: False}
    if isinstance(current, bool) or not isinstance(current, int | float):
        parser.error(f"--values sets an int or a float constant; {switch} is {current!r}")
    try:
        a, b = (type(current)(value) for value in given.split(","))
    except ValueError:
        parser.error(f"--values takes two {type(current).__name__}s, A,B (e.g. 8,4), not {given!r}")
    return module, name, {True: a, False: b}


if __name__ == "__main__":
    sys.exit(main())
