"""Foreign states: inverting hidden states lminvert did not compute itself, against its own, side by side.

    python benchmarks/bench_foreign.py                        # SmolLM2, layers 1,15,30, float32 and bfloat16
    python benchmarks/bench_foreign.py --layers 1 --dtypes float32 --prompts 2 --noise 1e-2   # a quick look

For each dtype and layer, in the same process, every prompt inverted three ways back to back (load changes hit all):

* ``own``   - ``lminvert.encode`` (each prompt alone, plain forward), inverted with ``source="exact"``: the baseline;
* ``right`` / ``left`` - all prompts in ONE padded batch as a deployment captures them (right, then left padding; the
  prompts cut by 0..3 tokens from their ends so that the batch really pads), the real tokens' rows taken out
  (:func:`lminvert.invert.layouts.padded_states`), wrapped as a bare array (``HiddenStates.from_array``) and inverted
  with ``source="float"`` (the error model of states computed elsewhere in the same dtype);
* ``eager`` (``--layouts right,left,eager``) - the same right-padded batch run with transformers' eager attention
  (what a capture that asks for attention weights, or another library's own attention, computes).

Then a noise sweep at ``--noise-layer`` in float32: ``invert(model, own_states, noise=level)`` (relative Gaussian
noise added and modelled by lminvert), against the noiseless ``own`` inversion of the same prompts, measured alongside.

All three captures invert the same token ids (the cut prompts), so times compare prompt for prompt; an untimed
warm-up inversion of a few positions per model and layer runs first. Columns: exact prompts; token accuracy; median
and max seconds per prompt; median and mean candidates verified per position; verdicts certified/confident/uncertain
(positions); wrong: positions recovered WRONG without an ``uncertain`` verdict (must be 0: printed loudly otherwise);
x own: median seconds over ``own``'s in the same dtype and layer (noise: over the noiseless median). The ``foreign
vs own`` lines: how far the captured states lie from lminvert's own (max relative L2 at position 0 and later), and
that against the ``float`` model's calibrated disagreement.
Targets (summary lines at the end): foreign float at every layer measured, every token right, median within 2x of
own, >= 95% of positions certified or confident, 0 wrong-and-not-uncertain; noise 1e-2 at layer 15, every token
right, median within 3x of noiseless. Timed sections hold /tmp/lminvert-bench.lock, as bench_invert.py does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import lminvert
from bench_invert import _summarise
from evalset import EvalPrompt, evaluation_prompts
from lminvert.invert.acceptor import UNCERTAIN, VERDICTS
from lminvert.invert.layouts import Disagreement, foreign_calibration, padded_states
from lminvert.invert.reader import reading_for
from lminvert.invert.tables import first_position_table, second_position_map
from lminvert.invert.tolerance import calibrate, screen_calibration
from lminvert.models.observed import attention

LAYOUTS = ("right", "left")  # the default captures; ``eager`` on request
WARM = 6  # positions of the untimed warm-up inversions
FOREIGN_TARGET = {"median_over_own": 2.0, "decided_share": 0.95}
NOISE_TARGET = {"level": 1e-2, "layer": 15, "median_over_noiseless": 3.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="1,15,30")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--prompts", type=int, default=7, help="how many of bench_invert.py's prompts (7: all of them)")
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--noise", default="1e-3,3e-3,1e-2,3e-2", help="relative levels of the sweep ('' for none)")
    ap.add_argument("--noise-layer", default="15")
    ap.add_argument("--device", default="cpu", help="cpu, auto, cuda, cuda:N or mps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="captures: right, left, eager (comma-separated)")
    ap.add_argument("--out", default="out/bench/foreign.json")
    args = ap.parse_args()

    lock = open(os.environ.get("LMINVERT_BENCH_LOCK", "/tmp/lminvert-bench.lock"), "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    started = time.perf_counter()
    dtypes = args.dtypes.split(",")
    levels = [float(x) for x in args.noise.split(",") if x.strip()]
    models = {dtype: lminvert.load_model(args.model, dtype=dtype, device=args.device) for dtype in dtypes}
    if levels and "float32" not in models:
        models["float32"] = lminvert.load_model(args.model, dtype="float32", device=args.device)
    model = next(iter(models.values()))
    prompts = _prompts(model, args.prompts, args.length, args.seed)
    layers = model.probe.layers(args.layers)
    device = _device(model)
    print(f"device: {device['torch']} ({device['name']}), threads={torch.get_num_threads()}")
    print(
        f"{args.model}: {len(prompts)} prompts of {args.length} tokens cut to {[len(p.ids) for p in prompts]} "
        f"({', '.join(p.kind for p in prompts)})"
    )
    report: dict = {
        "model": model.describe(),
        "dtypes": dtypes,
        "machine": {
            "platform": platform.platform(),
            "device": device,
            "threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "prompts": [{"kind": p.kind, "ids": list(p.ids)} for p in prompts],
        "layers": {},
        "layouts": args.layouts.split(","),
    }
    alarms: list[str] = []
    for layer in layers:
        print(f"\nlayer {layer}")
        entry: dict = {}
        for dtype in dtypes:
            label = f"{dtype} layer {layer}"
            entry[dtype] = _foreign(models[dtype], layer, prompts, args.seed, alarms, label, args.layouts.split(","))
        report["layers"][str(layer)] = entry
    if levels:
        report["noise"] = _noise_sweep(models["float32"], args.noise_layer, prompts, levels, args.seed, alarms)
    report["targets"] = _targets(report)
    report["wrong_not_uncertain"] = alarms
    report["seconds"] = time.perf_counter() - started
    if alarms:
        print(f"\n!!! {len(alarms)} position(s) recovered WRONG without an uncertain verdict:")
        for line in alarms:
            print(f"!!!   {line}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s in all)")
    return 0


def _prompts(model, n: int, length: int, seed: int) -> list[EvalPrompt]:
    """The first ``n`` of bench_invert.py's prompts (prose, code, random, personal; ``length`` tokens), prompt ``i``
    cut by ``i % 4`` tokens from its end: mixed lengths, so that a padded batch of them really pads."""
    pool = evaluation_prompts(model, max(1, -(-(n - 1) // 3)), length, seed)[:n]
    return [EvalPrompt(p.kind, p.ids[: len(p.ids) - i % 4]) for i, p in enumerate(pool)]


def _device(model) -> dict:
    dev = model.probe.device
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if dev.type == "cuda":
        name = f"{torch.cuda.get_device_name(dev)}; CPU {name}"
    return {"torch": str(dev), "name": name}


def _warm(model, layer) -> tuple[float, Disagreement]:
    """Everything invert() measures once per model, dtype and layer and caches (not in the times below)."""
    start = time.perf_counter()
    first_position_table(model, layer, progress=False)
    second_position_map(model, layer)
    calibrate(model, layer)
    reading_for(model, layer)
    if model.probe.can_screen:
        screen_calibration(model, layer)
    bound = foreign_calibration(model, layer)
    return time.perf_counter() - start, bound


def _foreign(model, layer, prompts, seed: int, alarms: list[str], label: str, layouts: list[str]) -> dict:
    """Own and ``layouts``' captures of ``prompts`` at ``layer``, each prompt inverted every way in a row."""
    warm, bound = _warm(model, layer)
    ids = [list(p.ids) for p in prompts]
    own = lminvert.encode(model, ids, layer)
    captured = {"own": own}
    for side in layouts:
        captured[side] = lminvert.HiddenStates.from_array(_captured(model, layer, ids, side))
    sources = {"own": "exact", **dict.fromkeys(layouts, "float")}
    print(
        f"  {model.dtype}: tables, reading, calibrations {warm:.1f} s (cached); float model's disagreement "
        f"{bound.first:.1e} at position 0, {bound.rest:.1e} later (relative); at sink-like positions "
        f"{', '.join(f'{rel:.1e} from norm {size:.0f}' for size, rel in bound.bands) or 'no more'}"
    )
    distance = {side: _distance(captured[side], own, bound) for side in layouts}
    for side, d in distance.items():
        print(
            f"  foreign vs own, {side}: max {d['first']:.1e} at position 0 ({d['first_over_bound']:.2f}x the float "
            f"model's), {d['rest']:.1e} later ({d['rest_over_bound']:.2f}x); {d['identical']}/{len(prompts)} "
            "prompts bit-identical to own"
        )
    _warm_invert(model, layer, [(captured[name], {"source": sources[name]}) for name in ("own", "right")], seed)
    results: dict[str, list] = {name: [] for name in captured}
    for i in range(len(prompts)):  # each prompt in every capture back to back: load changes hit all alike
        for name, states in captured.items():
            one = states.with_meta(states=states.states[i : i + 1])
            results[name] += lminvert.invert(model, one, layer, seed=seed, source=sources[name])
    rows = {name: _figures(res, prompts, alarms, f"{label} {name}") for name, res in results.items()}
    for name in captured:
        rows[name]["median_over_own"] = rows[name]["median_seconds"] / rows["own"]["median_seconds"]
        rows[name]["per_prompt_over_own_median"] = statistics.median(
            r.seconds / o.seconds for r, o in zip(results[name], results["own"], strict=True)
        )
        rows[name]["source"] = sources[name]
    _header()
    for name in captured:
        _row(f"{name}/{model.dtype}", rows[name], rows[name]["median_over_own"])
    return {
        "precompute_seconds": warm,
        "float_model": [bound.first, bound.rest],
        "sink_bands": [list(b) for b in bound.bands],
        "distance": distance,
        "captures": rows,
    }


def _warm_invert(model, layer, runs, seed: int) -> None:
    """Untimed: the first positions of the first prompt inverted once per run (``(states, invert() options)``), so
    that what the first call in a process pays (loading, allocations) falls on no timed prompt."""
    for states, options in runs:
        lminvert.invert(model, states.with_meta(states=(states.states[0][:WARM],)), layer, seed=seed, **options)


def _captured(model, layer, ids: list[list[int]], layout: str) -> list[torch.Tensor]:
    """Every prompt's states from one batch padded on the right or left, or (``eager``) on the right with the eager
    attention."""
    if layout != "eager":
        return padded_states(model.probe, layer, ids, layout)
    with attention(model.probe, "eager"):
        return padded_states(model.probe, layer, ids, "right")


def _distance(foreign, own, bound: Disagreement) -> dict:
    """Max relative L2 distance of the foreign capture from lminvert's own states, at position 0 and later."""
    first = rest = 0.0
    identical = 0
    for f, o in zip(foreign.states, own.states, strict=True):
        f, o = f.double(), o.double()
        rel = (f - o).norm(dim=1) / o.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        first, rest = max(first, float(rel[0])), max(rest, float(rel[1:].max()) if len(rel) > 1 else 0.0)
        identical += bool(torch.equal(f, o))
    return {
        "first": first,
        "rest": rest,
        "first_over_bound": first / bound.first if bound.first > 0 else float("inf"),
        "rest_over_bound": rest / bound.rest if bound.rest > 0 else float("inf"),
        "identical": identical,
    }


def _figures(results, prompts, alarms: list[str], label: str) -> dict:
    """bench_invert.py's summary, plus token accuracy, max seconds, verdict counts and wrong-and-not-uncertain
    positions by verdict (each one also recorded in ``alarms``, with where it is)."""
    rows = _summarise(results, prompts)
    right = total = 0
    wrong: list[dict] = []
    for i, (r, p) in enumerate(zip(results, prompts, strict=True)):
        total += len(p.ids)
        for t, truth in enumerate(p.ids):
            got = r.token_ids[t] if t < len(r.token_ids) else None
            right += got == truth
            pos = r.positions[t] if t < len(r.positions) else None
            if got != truth and pos is not None and pos.verdict != UNCERTAIN:
                wrong.append({"prompt": i, "position": t, "got": got, "true": truth, "verdict": pos.verdict,
                              "reason": pos.reason})  # fmt: skip
                alarms.append(
                    f"{label}: prompt {i} ({p.kind}) position {t}: got {got}, true {truth}, "
                    f"verdict {pos.verdict} ({pos.reason})"
                )
    counts = {v: sum(r.verdict_counts[v] for r in results) for v in VERDICTS}
    positions = sum(counts.values())
    rows.update(
        token_accuracy=right / total,
        max_seconds=max(r.seconds for r in results),
        verdicts=counts,
        decided_share=(positions - counts[UNCERTAIN]) / positions,
        wrong_not_uncertain=len(wrong),
        wrong_positions=wrong,
        reasons=sorted({p.reason for r in results for p in r.positions if p.reason}),
    )
    if wrong:
        print(f"  !!! {label}: {len(wrong)} position(s) WRONG and not uncertain: {wrong}")
    return rows


def _header() -> None:
    print(
        f"  | {'capture':<16} | {'exact':>5} | {'tok acc':>7} | {'med s':>6} | {'max s':>6} | {'med c/p':>7} | "
        f"{'mean c/p':>8} | {'cert/conf/unc':>13} | {'wrong':>5} | {'x own':>6} |"
    )


def _row(name: str, rows: dict, ratio: float) -> None:
    v = rows["verdicts"]
    verdicts = f"{v['certified']}/{v['confident']}/{v['uncertain']}"
    print(
        f"  | {name:<16} | {100 * rows['exact_rate']:>4.0f}% | {100 * rows['token_accuracy']:>6.1f}% | "
        f"{rows['median_seconds']:>6.2f} | {rows['max_seconds']:>6.2f} | "
        f"{rows['median_candidates_per_position']:>7.0f} | {rows['mean_candidates_per_position']:>8.1f} | "
        f"{verdicts:>13} | {rows['wrong_not_uncertain']:>5} | {ratio:>5.2f}x |"
    )


def _noise_sweep(model, layer_spec, prompts, levels: list[float], seed: int, alarms: list[str]) -> dict:
    """``invert(noise=level)`` of lminvert's own float32 states, against their noiseless inversion, prompt by prompt."""
    layer = model.probe.layer(layer_spec)
    print(f"\nnoise sweep, layer {layer}, {model.dtype} (relative Gaussian noise added and modelled by invert)")
    warm, _ = _warm(model, layer)
    own = lminvert.encode(model, [list(p.ids) for p in prompts], layer)
    _warm_invert(model, layer, [(own, {}), (own, {"noise": levels[0]})], seed)
    results: dict[float, list] = {level: [] for level in (0.0, *levels)}
    for i in range(len(prompts)):
        one = own.with_meta(states=own.states[i : i + 1])
        for level in results:
            results[level] += lminvert.invert(model, one, layer, seed=seed, noise=level)
    rows = {level: _figures(res, prompts, alarms, f"noise {level:g} layer {layer}") for level, res in results.items()}
    base = rows[0.0]["median_seconds"]
    for r in rows.values():
        r["median_over_noiseless"] = r["median_seconds"] / base
    _header()
    for level, r in rows.items():
        _row("noiseless" if level == 0 else f"noise {level:g}", r, r["median_over_noiseless"])
    recovered = [level for level in levels if rows[level]["token_accuracy"] == 1.0]
    largest = max(recovered, default=None)
    failed_below = [level for level in levels if largest is not None and level < largest and level not in recovered]
    if largest is None:
        print("  no noise level tested recovered every token")
    else:
        v = rows[largest]["verdicts"]
        print(
            f"  largest level with every token right: {largest:g} (verdicts {v['certified']} certified, "
            f"{v['confident']} confident, {v['uncertain']} uncertain)"
            + (f"; but not at {', '.join(f'{x:g}' for x in failed_below)}" if failed_below else "")
        )
    return {
        "layer": int(layer),
        "dtype": model.dtype,
        "precompute_seconds": warm,
        "levels": {f"{level:g}": r for level, r in rows.items()},
        "largest_all_right": largest,
        "largest_all_right_verdicts": None if largest is None else rows[largest]["verdicts"],
    }


def _targets(report: dict) -> dict:
    """One summary line per target, with every measured combination that misses it."""
    print("\nsummary")
    misses = []
    checked = 0
    for layer, entry in report["layers"].items():
        for dtype, e in entry.items():
            for side in report["layouts"]:
                r = e["captures"][side]
                checked += 1
                why = []
                if r["token_accuracy"] < 1.0:
                    why.append(f"tokens {100 * r['token_accuracy']:.1f}%")
                if r["median_over_own"] > FOREIGN_TARGET["median_over_own"]:
                    why.append(f"median {r['median_over_own']:.2f}x own")
                if r["decided_share"] < FOREIGN_TARGET["decided_share"]:
                    why.append(f"{100 * r['decided_share']:.1f}% certified/confident")
                if r["wrong_not_uncertain"]:
                    why.append(f"{r['wrong_not_uncertain']} wrong and not uncertain")
                if why:
                    misses.append(f"layer {layer} {dtype} {side}: {', '.join(why)}")
    layers = ",".join(report["layers"])
    foreign_ok = not misses and checked > 0
    worst = max(
        (e["captures"][s]["median_over_own"] for entry in report["layers"].values() for e in entry.values()
         for s in report["layouts"]), default=float("nan"),
    )  # fmt: skip
    print(
        f"  foreign float (layers {layers}; {', '.join(report['dtypes'])}; {', '.join(report['layouts'])}): "
        f"{'MET' if foreign_ok else 'NOT MET'} - every token right, "
        f"median <= {FOREIGN_TARGET['median_over_own']:g}x own "
        f"(worst {worst:.2f}x), >= {100 * FOREIGN_TARGET['decided_share']:.0f}% certified or confident, "
        "0 wrong and not uncertain"
        + ("; layers 1,15,30 not all measured" if not {"1", "15", "30"} <= set(report["layers"]) else "")
    )
    for m in misses:
        print(f"    miss: {m}")
    noise = report.get("noise")
    level = NOISE_TARGET["level"]
    row = None if noise is None else noise["levels"].get(f"{level:g}")
    if row is None or noise["layer"] != NOISE_TARGET["layer"]:
        noise_ok = None
        print(f"  noise {level:g} at layer {NOISE_TARGET['layer']}: NOT MEASURED (sweep: {_sweep_label(noise)})")
    else:
        within = row["median_over_noiseless"] <= NOISE_TARGET["median_over_noiseless"]
        noise_ok = row["token_accuracy"] == 1.0 and within
        print(
            f"  noise {level:g} at layer {noise['layer']}: {'MET' if noise_ok else 'NOT MET'} - tokens "
            f"{100 * row['token_accuracy']:.1f}% right, median {row['median_over_noiseless']:.2f}x noiseless "
            f"(target: all, <= {NOISE_TARGET['median_over_noiseless']:g}x); verdicts {row['verdicts']}"
        )
    return {"foreign": {"met": foreign_ok, "misses": misses, "worst_median_over_own": worst}, "noise": noise_ok}


def _sweep_label(noise: dict | None) -> str:
    if noise is None:
        return "none"
    return f"layer {noise['layer']}, levels {', '.join(noise['levels'])}"


if __name__ == "__main__":
    sys.exit(main())
