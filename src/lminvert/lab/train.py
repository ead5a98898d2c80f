"""`lminvert lab train`: does gradient descent keep prompts apart? (the paper's Theorem 2.3, made observable).

A small GPT-2-shaped model is trained from random initialisation on the built-in corpus, once with SGD and once
with Adam. Every ``every`` steps the run measures the training loss, a held-out loss and the exact minimum
pairwise distance of a fixed prompt set's last-token states at every block. Each measurement interval is one
unit of the shared runner and ends with a checkpoint (weights + optimiser state), so an interrupted run resumes
from its last checkpoint and, since batch ``i`` is drawn from a generator seeded by ``(seed, i)``, reproduces the
uninterrupted run. The trained models are saved as transformers directories (with the tokenizer) under
``models/<optimiser>``: ``--model DIR`` loads them in ``invert``, ``collisions`` and ``experiment``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..corpora import sample_prompts
from ..experiments.base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group, minima_figure
from ..forward import encode
from ..invert import invert
from ..models import LoadedModel, load_model
from ..report.text import fmt
from .common import corpus_ids, layer_minima, random_model, tokenizer

log = logging.getLogger(__name__)


def _optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimiser {name!r} (sgd or adam)")


class Train(Experiment):
    name = "train"
    title = "Injectivity through training: minimum distance per layer and loss, SGD and Adam"
    paper = (
        "Theorem 2.3: a gradient step is real-analytic with a Jacobian determinant not identically zero, so any "
        "finite number of (S)GD steps keeps the parameter distribution absolutely continuous and the model "
        "injective with probability one."
    )
    models = ()
    quick_size = {
        "hidden": 64,
        "layers": 2,
        "optimizers": ["sgd", "adam"],
        "lr": {"sgd": 0.1, "adam": 0.003},
        "steps": 40,
        "every": 20,
        "batch": 4,
        "seq": 16,
        "train_windows": 400,
        "eval_prompts": 200,
        "eval_tokens": 12,
        "invert_prompts": 1,
        "invert_layers": ["-1"],
    }
    full_size = {
        "hidden": 128,
        "layers": 4,
        "optimizers": ["sgd", "adam"],
        "lr": {"sgd": 0.3, "adam": 0.002},
        "steps": 120,
        "every": 20,
        "batch": 8,
        "seq": 32,
        "train_windows": 4000,
        "eval_prompts": 300,
        "eval_tokens": 24,
        "invert_prompts": 2,
        "invert_layers": ["1", "-1"],
    }
    full_duration = "about 17 minutes on 2 shared, busy cores (2 optimisers x 120 steps, 300 prompts every 20 steps)"

    def units(self, ctx: Context) -> list[Unit]:
        s, units = ctx.size, []
        for opt in s["optimizers"]:
            for a in range(0, s["steps"], s["every"]):
                b = min(a + s["every"], s["steps"])
                units.append(Unit(f"{opt}.steps{a:06d}-{b:06d}", f"{opt} steps {a}-{b}", {"opt": opt, "a": a, "b": b}))
            units.append(Unit(f"{opt}.export", f"{opt} save + invert", {"opt": opt, "export": True}))
        return units

    # ------------------------------------------------------------------ training
    def _checkpoint(self, ctx: Context, opt: str, step: int) -> Path:
        return ctx.directory / "checkpoints" / opt / f"step{step:06d}.pt"

    def _model_and_optimizer(self, ctx: Context, opt: str, step: int):
        s = ctx.size
        net = random_model("gpt2", ctx.seed, len(tokenizer(ctx)), s["hidden"], s["layers"])
        optimizer = _optimizer(opt, net.parameters(), s["lr"][opt])
        if step > 0:
            state = torch.load(self._checkpoint(ctx, opt, step), map_location="cpu", weights_only=True)
            net.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return net, optimizer

    def _save(self, ctx: Context, opt: str, step: int, net, optimizer) -> None:
        path = self._checkpoint(ctx, opt, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
        partial.replace(path)  # atomic: a checkpoint file is always complete

    def _train_windows(self, ctx: Context) -> torch.Tensor:
        def draw() -> torch.Tensor:
            s = ctx.size
            prompts, _ = sample_prompts(
                tokenizer(ctx), "mixed", s["train_windows"], max_tokens=s["seq"], seed=ctx.seed, min_tokens=s["seq"]
            )
            return torch.tensor([list(p.ids) for p in prompts], dtype=torch.long)

        return ctx.once("train_windows", draw)

    def _measure(self, ctx: Context, net, opt: str, step: int, losses: Sequence[float]) -> list[Row]:
        s = ctx.size
        ids = corpus_ids(ctx, s["eval_prompts"], s["eval_tokens"], ctx.seed + 1)
        snapshot = LoadedModel.wrap(f"train-{opt}@{step}", copy.deepcopy(net), tokenizer(ctx))
        with torch.no_grad():
            held = torch.tensor(ids[:64], dtype=torch.long)
            eval_loss = float(snapshot.model(input_ids=held, labels=held).loss)
        minima = layer_minima(snapshot, ids, range(1, s["layers"] + 1))
        train_loss = statistics.fmean(losses) if losses else None
        return [
            {"opt": opt, "step": step, "layer": layer, "train_loss": train_loss, "eval_loss": eval_loss, **m}
            for layer, m in minima.items()
        ]

    def _train(self, ctx: Context, opt: str, a: int, b: int) -> list[Row]:
        net, optimizer = self._model_and_optimizer(ctx, opt, a)
        windows = self._train_windows(ctx)
        rows = self._measure(ctx, net, opt, 0, []) if a == 0 else []
        net.train().requires_grad_(True)
        losses = []
        for step in tqdm(range(a, b), desc=f"{opt} training", unit="step", leave=False, disable=None):
            rng = np.random.default_rng([ctx.seed, step])
            batch = windows[torch.from_numpy(rng.choice(len(windows), ctx.size["batch"], replace=False))]
            with torch.random.fork_rng(devices=[]):  # dropout masks from (seed, step): a resumed run is identical
                torch.manual_seed(int(rng.integers(2**62)))
                loss = net(input_ids=batch, labels=batch).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        net.eval()
        self._save(ctx, opt, b, net, optimizer)
        rows += self._measure(ctx, net, opt, b, losses)
        log.info("%s steps %d-%d: loss %.3f -> %.3f", opt, a, b, losses[0], losses[-1])
        return rows

    # ------------------------------------------------------------------ export
    def model_dir(self, ctx: Context, opt: str) -> Path:
        return ctx.directory / "models" / opt

    def _export(self, ctx: Context, opt: str) -> list[Row]:
        s = ctx.size
        net, _ = self._model_and_optimizer(ctx, opt, s["steps"])
        path = self.model_dir(ctx, opt)
        net.save_pretrained(path)
        tokenizer(ctx).save_pretrained(path)
        model = load_model(str(path))  # as `--model DIR` loads it
        ids = corpus_ids(ctx, s["eval_prompts"], s["eval_tokens"], ctx.seed + 1)[: s["invert_prompts"]]
        rows = []
        for layer in s["invert_layers"]:
            states = encode(model, ids, layer)
            start = time.perf_counter()
            results = invert(model, states)
            seconds = time.perf_counter() - start
            for prompt, result in zip(ids, results, strict=True):
                rows.append(
                    {
                        "opt": opt,
                        "export": True,
                        "path": str(path.relative_to(ctx.directory)),
                        "layer_spec": layer,
                        "tokens": len(prompt),
                        "exact": list(result.token_ids) == list(prompt),
                        "uncertain": len(result.uncertain_positions),
                        "explored": result.explored_fraction,
                        "seconds": seconds / len(ids),
                    }
                )
        return rows

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        p = unit.params
        if p.get("export"):
            return self._export(ctx, p["opt"])
        return self._train(ctx, p["opt"], p["a"], p["b"])

    # ------------------------------------------------------------------ summary
    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        curves = [r for r in rows if not r.get("export")]
        exports = [r for r in rows if r.get("export")]
        by_opt = group(curves, "opt")
        tables = [_curves_table(ctx, by_opt)]
        if exports:
            tables.append(_exports_table(exports))
        figures = [_loss_figure(by_opt), _minima_figure(by_opt)]
        return Summary(tables, figures)


def _curves_table(ctx: Context, by_opt: dict[tuple, list[Row]]) -> Table:
    """One row per (optimiser, step): losses, the minimum distance at the first and last layer, collisions."""
    top = ctx.size["layers"]
    table_rows = []
    for (opt,), rs in by_opt.items():
        for (step,), sr in group(rs, "step").items():
            by = {r["layer"]: r for r in sr}
            table_rows.append(
                [
                    opt,
                    step,
                    fmt(sr[0]["train_loss"]),
                    fmt(sr[0]["eval_loss"]),
                    fmt(by[1]["min_distance"]),
                    fmt(by[top]["min_distance"]),
                    sum(r["below_threshold"] for r in sr),
                ]
            )
    return Table(
        "Loss and minimum pairwise distance through training",
        [
            "optimiser",
            "step",
            "training loss",
            "held-out loss",
            "min distance, layer 1",
            f"min distance, layer {top}",
            "pairs < 1e-6",
        ],
        table_rows,
        note=(
            f"GPT-2 shape, width {ctx.size['hidden']}, {top} blocks, trained from random initialisation on the "
            f"built-in corpus (batch {ctx.size['batch']} x {ctx.size['seq']} tokens; SGD with momentum 0.9, "
            f"Adam; learning rates {ctx.size['lr']}). Distances: last-token states of "
            f"{ctx.size['eval_prompts']:,} fixed corpus prompts; training loss: mean over the "
            "interval before the step."
        ),
    )


def _exports_table(exports: list[Row]) -> Table:
    """The trained models as saved, loaded back by path and inverted (the ``export`` units' rows)."""
    return Table(
        "The trained models: saved, loaded back with --model DIR, inverted",
        [
            "optimiser",
            "directory",
            "layer",
            "tokens",
            "exact",
            "uncertain positions",
            "explored vocabulary",
            "seconds",
        ],
        [
            [
                r["opt"],
                r["path"],
                r["layer_spec"],
                r["tokens"],
                r["exact"],
                r["uncertain"],
                f"{100 * r['explored']:.3f}%",
                fmt(r["seconds"]),
            ]
            for r in exports
        ],
        note="Each directory loads anywhere: `lminvert invert --model RUN/models/adam ...`.",
    )


def _loss_figure(by_opt: dict[tuple, list[Row]]) -> FigureSpec:
    """Held-out loss per step, one line per optimiser."""
    loss_series = []
    for (opt,), rs in by_opt.items():
        steps = group(rs, "step")
        loss_series.append(
            Series(f"{opt} held-out loss", [k[0] for k in steps], [v[0]["eval_loss"] for v in steps.values()])
        )
    return FigureSpec(
        "train_loss",
        "Held-out loss through training: both optimisers learn.",
        title="Loss",
        xlabel="step",
        ylabel="cross-entropy (nats)",
        series=loss_series,
    )


def _minima_figure(by_opt: dict[tuple, list[Row]]) -> FigureSpec:
    """Minimum pairwise distance per step, one line per (optimiser, layer), with the collision threshold."""
    dist_series = []
    for (opt,), rs in by_opt.items():
        for (layer,), lr in group(rs, "layer").items():
            dist_series.append(
                Series(f"{opt}, layer {layer}", [r["step"] for r in lr], [r["min_distance"] for r in lr])
            )
    return minima_figure(
        "train_minima",
        "Minimum pairwise distance of last-token states per layer through training: it moves, but stays "
        "far above the collision threshold.",
        title="Injectivity through training",
        xlabel="step",
        series=dist_series,
    )
