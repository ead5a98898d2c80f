"""The audit's rows search (``lminvert audit``'s attack on rows a defence changed, a KV cache, a projection) in
several configurations, in the same process:

* ``plain``  - no memo, no reading, no lookahead, batches of 256: every defence's search runs all its candidates
  through the model, each position's first batch is the model's prediction, position 0 is the nearest first token;
* ``memo``   - batches of 256, one :class:`lminvert.invert.rows.memo.StateMemo` for every defence's search at the layer:
  a candidate another defence's search already verified over the same prefix is not run through the model again;
* ``read``   - the memo, and half of each first batch from what the shipped row reads as (states leaks:
  :class:`lminvert.invert.rows.rankers.StateReading`);
* ``look``   - the memo, and where several first tokens fit, the next row chooses among them (``RowSearch(lookahead)``);
* ``wide``   - all three, every batch of candidates ``BATCH`` (256);
* ``nosecant`` - all three, each position's first batch ``FIRST`` (32), then the rest of ``BATCH``, then ``BATCH``
  per batch, later batches from the rankers' order and the ridge fit alone;
* ``noreuse`` - the same, the secant model's order in every later batch too
  (:class:`lminvert.invert.rows.rankers.Secant`),
  the recovered prefix grown by a forward through every block wherever it grows;
* ``noscreen`` - the same, the prefix grown from the chosen candidate's own forward, only the blocks above the layer
  running for it (``RowSearch(reuse)``, :class:`lminvert.invert.rows.running.Running`);
* ``all``    - the same, later batches of 64 candidates or more screened with bfloat16 GEMMs first where that pays
  (:mod:`lminvert.invert.rows.screen`; the audit's default).

    python benchmarks/bench_audit.py                                   # SmolLM2, states, layers 1,15,30, 4 x 12
    python benchmarks/bench_audit.py --layers 15 --prompts 2 --length 8 --configs memo,all   # a quick look

For each leak and layer the defences run one after another over the same prompts, as an audit's units do, and for
each defence the configurations back to back (interleaved: load changes hit all), each with its own memo. Printed per
defence and configuration: seconds (the searches' own, over every prompt; calibrations, tables and the reading map
are made before, untimed), candidates run through the model per position, tokens right, verdicts
(certified/confident/uncertain) and wrong tokens claimed certified or confident (must be 0: printed loudly otherwise);
then the totals and each configuration's time over the first one's. Timed sections hold /tmp/lminvert-bench.lock, as
bench_invert.py does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

import lminvert
from lminvert.audit import make_leak, parse_defence
from lminvert.experiments.prompts import evaluation_prompts
from lminvert.invert.rows.attack import Attack
from lminvert.invert.rows.search import BATCH, FIRST

ALL = {"memo": True, "reading": True, "lookahead": True, "first": FIRST, "secant": True, "reuse": True, "screen": None}
OFF = {"secant": False, "reuse": False, "screen": False}
CONFIGS = {
    "plain": {**ALL, **OFF, "memo": False, "reading": False, "lookahead": False, "first": BATCH},
    "memo": {**ALL, **OFF, "reading": False, "lookahead": False, "first": BATCH},
    "read": {**ALL, **OFF, "lookahead": False, "first": BATCH},
    "look": {**ALL, **OFF, "reading": False, "first": BATCH},
    "wide": {**ALL, **OFF, "first": BATCH},
    "nosecant": {**ALL, **OFF},
    "noreuse": {**ALL, "reuse": False, "screen": False},
    "noscreen": {**ALL, "screen": False},
    "all": ALL,
}
DEFENCES = "noise:0.001,noise:0.01,quant:bf16,quant:fp8,quant:int8,quant:int4,drop:0.25,project:128"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, auto, cuda, cuda:N or mps")
    ap.add_argument("--leaks", default="states")
    ap.add_argument("--layers", default="1,15,30")
    ap.add_argument("--defences", default=DEFENCES)
    ap.add_argument("--prompts", type=int, default=4, help="prompts, half prose and half chat-formatted")
    ap.add_argument("--length", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="memo,all", help=f"of {','.join(CONFIGS)}; ratios against the first")
    ap.add_argument("--out", default="out/bench/audit.json")
    args = ap.parse_args()

    lock = open(os.environ.get("LMINVERT_BENCH_LOCK", "/tmp/lminvert-bench.lock"), "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    model = lminvert.load_model(args.model, dtype=args.dtype, device=args.device)
    found = evaluation_prompts(model, max(1, args.prompts // 2), args.length, args.seed, kinds=["prose", "chat"])
    prompts = [list(p.ids) for p in found][: args.prompts]
    where = torch.cuda.get_device_name() if model.probe.device.type == "cuda" else platform.processor() or "cpu"
    threads = torch.get_num_threads()
    print(f"{model.describe()}, {len(prompts)} prompts of {args.length} tokens; {where}, {threads} threads")
    report: dict = {"model": model.describe(), "prompts": len(prompts), "length": args.length, "cells": []}
    wrong_total = 0
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}: choose among {','.join(CONFIGS)}")
    totals = {name: 0.0 for name in configs}
    for kind in args.leaks.split(","):
        for layer in model.probe.layers([int(x) if x.lstrip("-").isdigit() else x for x in args.layers.split(",")]):
            leak = make_leak(kind, model, layer)
            attacks = {name: Attack(leak, **CONFIGS[name]) for name in configs}
            clean = [leak.capture(ids) for ids in prompts]
            for label in args.defences.split(","):
                defence = parse_defence(label)
                generator = torch.Generator().manual_seed(args.seed * 7919 + sum(map(ord, f"{kind}{layer}{label}")))
                shipped = [defence.apply(rows, generator) for rows in clean]
                for attack in attacks.values():  # untimed, two positions: calibrations, table, reading map
                    memo, attack.memo = attack.memo, None
                    attack.run([replace(shipped[0], rows=shipped[0].rows[:2])])
                    attack.memo = memo
                for name, attack in attacks.items():
                    before = attack.memo.computed if attack.memo is not None else 0
                    results = attack.run(shipped)
                    cell = _cell(kind, str(layer), label, name, prompts, results)
                    if attack.memo is not None:
                        cell["memo_computed_per_position"] = (attack.memo.computed - before) / cell["positions"]
                    totals[name] += cell["seconds"]
                    wrong_total += cell["wrong_claimed"]
                    report["cells"].append(cell)
                    print(_line(cell), flush=True)
    base = totals[configs[0]]
    print("total seconds: " + ", ".join(f"{n} {s:.1f} ({s / base:.2f}x)" for n, s in totals.items()))
    report["totals"] = totals
    report["wrong_claimed"] = wrong_total
    if wrong_total:
        print(f"WRONG TOKENS CLAIMED CERTIFIED OR CONFIDENT: {wrong_total}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if wrong_total else 0


def _cell(kind: str, layer: str, label: str, name: str, prompts: list[list[int]], results) -> dict:
    right = [a == b for r, ids in zip(results, prompts, strict=True) for a, b in zip(r.token_ids, ids, strict=True)]
    verdicts = [v for r in results for v in r.verdicts]
    claimed = [v in ("certified", "confident") for v in verdicts]
    return {
        "leak": kind, "layer": layer, "defence": label, "config": name,
        "seconds": sum(r.seconds for r in results), "positions": len(right),
        "checked_per_position": sum(sum(r.checked) for r in results) / len(right),
        "right": sum(right), "routes": sorted({r.route for r in results}),
        "verdicts": {v: verdicts.count(v) for v in ("certified", "confident", "uncertain")},
        "wrong_claimed": sum(c and not r for c, r in zip(claimed, right, strict=True)),
    }  # fmt: skip


def _line(cell: dict) -> str:
    v = cell["verdicts"]
    memo = f", {cell['memo_computed_per_position']:.0f} run/pos." if "memo_computed_per_position" in cell else ""
    return (
        f"  {cell['leak']} L{cell['layer']} {cell['defence']:<12} {cell['config']:<6} {cell['seconds']:7.2f} s  "
        f"{cell['checked_per_position']:7.0f} cand./pos.{memo}  right {cell['right']}/{cell['positions']}  "
        f"{v['certified']}/{v['confident']}/{v['uncertain']}  wrong {cell['wrong_claimed']}  {','.join(cell['routes'])}"
    )


if __name__ == "__main__":
    sys.exit(main())
