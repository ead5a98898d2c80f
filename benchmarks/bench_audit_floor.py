"""The least a full-size audit's rows searches can cost on this machine: per position, the forward of its first batch
of candidates (``search.FIRST``, at the layer, over the prompt's prefix), and the recovered prefix grown by the chosen
token with the model's next prediction (:class:`lminvert.invert.rows.running.Running`: the blocks above the layer on the
candidate's state, or where nothing can be reused, layer 0, one forward through every block), times every position of
every cell the rows search runs (the ``states`` leak's defences but ``none`` and ``permute``, which the engine runs;
every defence of the ``kv`` leak). A search that needs nothing beyond its first batch at any position, never
guesses and never looks ahead costs this; the measured audit costs more wherever a position needs later batches.
The floor with a single candidate per position (one forward each) is printed beside it.

    python benchmarks/bench_audit_floor.py                  # SmolLM2, layers 1,15,30, 20 prompts of 20 tokens

Each forward's time is the median of ``--repeats`` over a prefix of half the prompt's length (the mean position).
Timed sections hold /tmp/lminvert-bench.lock, as the other benchmarks do.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import os
import platform
import statistics
import sys
import time

import torch

import lminvert
from lminvert.audit import make_leak
from lminvert.audit.defences import DEFAULT
from lminvert.invert.rows.running import Running
from lminvert.invert.rows.search import FIRST

TOKEN = 100  # the candidates run: TOKEN and the tokens after it
ENGINE = ("none", "permute")  # the states leak's defences the engine runs, not the rows search


def _median(run, repeats: int, setup=lambda: None) -> float:
    """The median seconds of ``run(setup())`` over ``repeats`` (``setup`` untimed; one more run first, to warm)."""
    times = []
    for _ in range(repeats + 1):
        given = setup()
        start = time.perf_counter()
        run(given)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _running(model, layer, prefix_ids: torch.Tensor) -> Running:
    """A recovered prefix of ``prefix_ids`` at ``layer``, its cache computed."""
    running = Running(model, layer)
    for token in prefix_ids.tolist():
        running.add(token)
    running.prefix()
    return running


def _offered(model, layer, prefix_ids: torch.Tensor) -> Running:
    """A fresh recovered prefix whose last batch of candidates held ``TOKEN`` alone."""
    fresh = _running(model, layer, prefix_ids)
    fresh.candidates(torch.tensor([TOKEN]))
    return fresh


def _grown(fresh: Running) -> None:
    """``TOKEN`` chosen: the blocks above the layer on its state (or one forward through all), and the prediction
    that gives the next position's first candidates."""
    fresh.add(TOKEN)
    fresh.log_probs()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default="1,15,30")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    lock = open(os.environ.get("LMINVERT_BENCH_LOCK", "/tmp/lminvert-bench.lock"), "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    model = lminvert.load_model(args.model, device=args.device)
    probe = model.probe
    where = torch.cuda.get_device_name() if probe.device.type == "cuda" else platform.processor() or "cpu"
    print(f"{model.describe()}; {where}, {torch.get_num_threads()} threads")
    prefix_ids = torch.randint(0, probe.vocab_size, (args.length // 2,), generator=torch.Generator().manual_seed(0))
    positions = args.prompts * args.length
    total = {"first": 0.0, "one": 0.0}
    for kind in ("states", "kv"):
        cells = len(DEFAULT) - (len(ENGINE) if kind == "states" else 0)
        for layer in probe.layers([int(x) if x.lstrip("-").isdigit() else x for x in args.layers.split(",")]):
            leak = make_leak(kind, model, layer)
            running = _running(model, leak.states_layer, prefix_ids)
            first = _median(lambda _, r=running: r.candidates(torch.arange(FIRST) + TOKEN), args.repeats)
            single = _median(lambda _, r=running: r.candidates(torch.tensor([TOKEN])), args.repeats)
            grow = _median(_grown, args.repeats, functools.partial(_offered, model, leak.states_layer, prefix_ids))
            per_first, per_one = (first + grow) * positions * cells, (single + grow) * positions * cells
            total["first"] += per_first
            total["one"] += per_one
            print(
                f"  {kind:<6} L{layer!s:<3} {cells:2d} cells, first batch of {FIRST} {first * 1e3:6.1f} ms, one "
                f"candidate {single * 1e3:6.1f} ms, grown and predicted {grow * 1e3:6.1f} ms: "
                f"{per_first / 60:5.1f} min ({per_one / 60:4.1f} min with one candidate per position)"
            )
    print(
        f"floor for {args.prompts} prompts of {args.length} tokens: {total['first'] / 60:.1f} min with a first batch "
        f"of {FIRST} per position, {total['one'] / 60:.1f} min with one candidate per position"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
