"""The paper's method table (§4.2): SIPIT against brute force, HardPrompts and the sequential baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..forward import encode
from ..invert.baseline import sequential_baseline
from ..invert.hardprompts import hard_prompts
from ..models import LoadedModel
from ..report.text import pm
from .base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group, mean_std, rate_se
from .measure import inversion_row, score
from .prompts import evaluation_prompts

PAPER_ROWS = [  # GPT-2 small, 20-token prompts, one GPU (the paper's table)
    ("paper: HardPrompts", "6132.59 ± 104.61", "0.00"),
    ("paper: BruteForce", "3889.61 ± 691.17", "1.00"),
    ("paper: SIPIT", "28.01 ± 35.87", "1.00"),
]


def natural_prompts(ctx: Context, model: LoadedModel, n: int, length: int) -> list[tuple[str, list[int]]]:
    """``n`` prompts of ``length`` tokens alternating prose and code (the same for every method)."""
    key = ("natural", model.name, n, length)
    prompts = ctx.once(key, lambda: evaluation_prompts(model, (n + 1) // 2, length, ctx.seed, kinds=("prose", "code")))
    ordered = [p for pair in zip(prompts[: (n + 1) // 2], prompts[(n + 1) // 2 :], strict=False) for p in pair]
    return [(p.kind, list(p.ids)) for p in (ordered + prompts)[:n]]


class Methods(Experiment):
    name = "methods"
    title = "Inversion methods: SIPIT against brute force, HardPrompts (PEZ) and the sequential baseline"
    paper = (
        "GPT-2 small, 20-token prompts, all positions' states at one layer, one GPU: HardPrompts 6132.59 ± 104.61 s "
        "with accuracy 0.00; BruteForce 3889.61 ± 691.17 s, 1.00; SIPIT 28.01 ± 35.87 s, 1.00."
    )
    models = ("smollm2-135m", "gpt2-small-random")
    quick_models = ("smollm2-135m",)
    quick_size = {
        "prompts": 2,
        "length": 4,
        "layer": "1",
        "policies": ["linear", "secant"],
        "bruteforce_prompts": 1,
        "bruteforce_positions": 1,
        "baseline_prompts": 1,
        "baseline_seconds": 15.0,
        "hardprompts_prompts": 1,
        "hardprompts_steps": 40,
    }
    full_size = {
        "prompts": 5,
        "length": 20,
        "layer": "middle",
        "policies": ["linear", "secant"],
        "bruteforce_prompts": 1,
        "bruteforce_positions": 1,
        "baseline_prompts": 1,
        "baseline_seconds": 300.0,
        "hardprompts_prompts": 2,
        "hardprompts_steps": 200,
    }
    full_duration = "about 35 minutes (SmolLM2 and gpt2-small-random; brute force, baseline and HardPrompts dominate)"

    def units(self, ctx: Context) -> list[Unit]:
        s = ctx.size
        units = []
        for model in ctx.models:
            plan = [(f"sipit-{p}", s["prompts"]) for p in s["policies"]]
            plan += [("bruteforce", s["bruteforce_prompts"]), ("baseline", s["baseline_prompts"])]
            plan += [("hardprompts", s["hardprompts_prompts"])]
            for method, n in plan:
                for i in range(min(n, s["prompts"])):
                    key = f"{model}.{method}.{i}"
                    units.append(Unit(key, f"{model} {method} prompt {i}", {"model": model, "method": method, "i": i}))
        return units

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        s, p = ctx.size, unit.params
        model = ctx.load(p["model"])
        layer = model.probe.layer(s["layer"])
        kind, ids = natural_prompts(ctx, model, s["prompts"], s["length"])[p["i"]]
        row: Row = {"model": p["model"], "method": p["method"], "prompt": p["i"], "kind": kind, "layer": layer.name}
        method = p["method"]
        if method.startswith("sipit-"):
            row.update(inversion_row(model, ids, layer, policy=method.removeprefix("sipit-"), seed=ctx.seed))
        elif method == "bruteforce":
            # every vocabulary entry at every position: |V| verifications each, so only the first positions are
            # measured (causality makes them a valid prompt of their own) and the time is projected to the length
            k = min(s["bruteforce_positions"], len(ids))
            row.update(inversion_row(model, ids[:k], layer, method="bruteforce", seed=ctx.seed))
            row.update(positions_measured=k, seconds_measured=row["seconds"], seconds=row["seconds"] * len(ids) / k)
        elif method == "baseline":
            states = encode(model, [ids], layer)
            b = sequential_baseline(model, states.states[0], layer, time_limit=s["baseline_seconds"])
            row.update(score(ids, b.token_ids, [i for i, v in enumerate(b.verdicts) if v == "uncertain"]))
            row.update(
                seconds=b.seconds,
                candidates_per_position=sum(b.candidates_checked) / max(len(b.candidates_checked), 1),
                explored=sum(b.candidates_checked) / (max(len(b.candidates_checked), 1) * model.probe.vocab_size),
                # positions not reached, and those the acceptor could not decide
                uncertain=len(ids) - len(b.candidates_checked) + b.verdicts.count("uncertain"),
                complete=b.complete,
                positions_done=len(b.candidates_checked),
            )
        else:
            states = encode(model, [ids], layer)
            h = hard_prompts(model, states.states[0], layer, steps=s["hardprompts_steps"], seed=ctx.seed)
            row.update(score(ids, h.token_ids, range(len(ids))))  # no position is ever certified
            row.update(seconds=h.seconds, steps=h.steps, best_loss=h.best_loss, complete=True, uncertain=len(ids))
        row["threads"] = torch.get_num_threads()
        return [row]

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        tables, series = [], []
        for (model,), model_rows in group(rows, "model").items():
            table_rows = []
            names, means, stds = [], [], []
            for (method,), rs in group(model_rows, "method").items():
                mean, std = mean_std([r["seconds"] for r in rs])
                table_rows.append(_method_row(ctx, method, rs, mean, std))
                names.append(method)
                means.append(mean)
                stds.append(std)
            table_rows += [[name, "-", t, a, "-", None, "-"] for name, t, a in PAPER_ROWS]
            layer = model_rows[0]["layer"]
            tables.append(
                Table(
                    f"{model}, layer {layer}, {ctx.size['length']}-token prompts",
                    [
                        "method",
                        "prompts",
                        "seconds (mean ± sd)",
                        "exact match ± se",
                        "token accuracy",
                        "cand./pos.",
                        "wrong, not flagged",
                    ],
                    table_rows,
                    note=(
                        "Ours: this CPU, float32; the paper's rows: GPT-2 small on a GPU, prompt source and layer not "
                        "stated. HardPrompts never certifies a position (every position counts as flagged), so its "
                        "wrong tokens are not silent. The sequential baseline is the paper's released procedure "
                        "(one candidate per gradient step, full uncached forwards); where it hit its time limit its "
                        "time is a lower bound and its accuracy counts the positions it did not reach as wrong. "
                        "Brute force verifies all |V| tokens at each position: its exactness is over the positions "
                        "measured and its time is the measured time per position times the prompt length."
                    ),
                )
            )
            series.append(Series(model, names, means, stds))
        figure = FigureSpec(
            "methods_time",
            "Seconds per prompt by method (log scale): SIPIT should sit orders of magnitude below brute force, "
            "HardPrompts and the sequential baseline.",
            kind="bar",
            title="Time per prompt by method",
            ylabel="seconds per prompt",
            series=series,
            logy=True,
        )
        notes = []
        if any("random" in model for (model,) in group(rows, "model")):
            notes.append(
                "A randomly initialised model's residual stream is dominated by the input embedding (its blocks "
                "add small updates), so methods that look for the nearest embedding row (the sequential baseline's "
                "first gradient step, HardPrompts' projection) can succeed on it where they fail on a trained model; "
                "the paper's GPT-2 small is trained."
            )
        return Summary(tables, [figure], notes)


def _method_row(ctx: Context, method: str, rs: Sequence[Row], mean: float, std: float) -> list:
    """The table row of one method (``mean``, ``std``: its seconds per prompt)."""
    acc, se = rate_se(sum(r["exact"] for r in rs), len(rs))
    tok, _ = mean_std([r["token_accuracy"] for r in rs])
    cpp = [r["candidates_per_position"] for r in rs if "candidates_per_position" in r]
    timed_out = sum(1 for r in rs if not r.get("complete", True))
    label = method + (f" ({timed_out} stopped at {ctx.size['baseline_seconds']:g} s)" if timed_out else "")
    if method == "bruteforce":
        label += f" (first {rs[0]['positions_measured']} positions measured, time projected)"
    wrong = sum(r.get("wrong_unflagged", 0) for r in rs) if method != "hardprompts" else "n/a"
    return [label, len(rs), pm(mean, std), f"{acc:.2f} ± {se:.2f}", tok, mean_std(cpp)[0] if cpp else None, wrong]
