"""`lminvert lab init`: injectivity at random initialisation (the paper's Theorem 2.2), made observable.

Many seeds of small GPT-2 and Llama shapes, each randomly initialised; the same corpus prompts go through every
one, and the exact minimum pairwise distance of their last-token states is measured at every block. The theorem
says a collision has probability zero for any seed: the minimum should stay well above the 1e-6 threshold, seed
after seed, at every layer.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..experiments.base import Context, Experiment, Row, Series, Summary, Table, Unit, group, minima_figure
from ..models import LoadedModel
from ..report.text import fmt, pm
from .common import corpus_ids, layer_minima, random_model, tokenizer


class Init(Experiment):
    name = "init"
    title = "Injectivity at random initialisation: minimum distance per layer across seeds"
    paper = (
        "Theorem 2.2: for parameters drawn from any density, distinct prompts give distinct last-token "
        "representations with probability one (a real-analytic map is zero only on a measure-zero set)."
    )
    models = ()
    quick_size = {
        "architectures": ["gpt2", "llama"],
        "seeds": 3,
        "hidden": 64,
        "layers": 4,
        "prompts": 200,
        "max_tokens": 12,
    }
    full_size = {
        "architectures": ["gpt2", "llama"],
        "seeds": 10,
        "hidden": 128,
        "layers": 6,
        "prompts": 2000,
        "max_tokens": 24,
    }
    full_duration = "about 7 minutes on 2 shared cores (2 architectures x 10 seeds, 2,000 prompts, 6 layers)"

    def units(self, ctx: Context) -> list[Unit]:
        return [
            Unit(f"{arch}.seed{seed:03d}", f"{arch} seed {seed}", {"arch": arch, "seed": ctx.seed + seed})
            for arch in ctx.size["architectures"]
            for seed in range(ctx.size["seeds"])
        ]

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        s, arch, seed = ctx.size, unit.params["arch"], unit.params["seed"]
        ids = corpus_ids(ctx, s["prompts"], s["max_tokens"], ctx.seed)
        vocab = len(tokenizer(ctx))
        net = random_model(arch, seed, vocab, s["hidden"], s["layers"])
        model = LoadedModel.wrap(f"random-{arch}@{seed}", net, tokenizer(ctx))
        minima = layer_minima(model, ids, range(1, s["layers"] + 1))
        return [
            {
                "arch": arch,
                "seed": seed,
                "layer": layer,
                "prompts": len(ids),
                "pairs": len(ids) * (len(ids) - 1) // 2,
                **m,
            }
            for layer, m in minima.items()
        ]

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        table_rows, series = [], []
        for (arch,), rs in group(rows, "arch").items():
            by_layer = group(rs, "layer")
            xs, means, stds, lows = [], [], [], []
            for (layer,), lr in by_layer.items():
                values = [r["min_distance"] for r in lr]
                mean = statistics.fmean(values)
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                xs.append(layer)
                means.append(mean)
                stds.append(std)
                lows.append(min(values))
                table_rows.append(
                    [
                        arch,
                        layer,
                        len(lr),
                        pm(mean, std),
                        fmt(min(values)),
                        fmt(max(values)),
                        sum(r["below_threshold"] for r in lr),
                        fmt(statistics.fmean(r["mean_norm"] for r in lr)),
                    ]
                )
            series.append(Series(f"{arch} (mean ± std over seeds)", xs, means, stds))
            series.append(Series(f"{arch} (smallest over seeds)", xs, lows))
        table = _minima_table(ctx, rows[0], table_rows)
        figure = minima_figure(
            "init_minima",
            "Minimum pairwise distance per layer at random initialisation, mean ± std over seeds and the smallest "
            "seed: every seed stays orders of magnitude above the collision threshold.",
            title="Injectivity at initialisation",
            xlabel="layer (block output)",
            series=series,
        )
        collided = sum(r["below_threshold"] for r in rows)
        notes = [f"Pairs under the threshold over all seeds and layers: {collided}."]
        return Summary([table], [figure], notes)


def _minima_table(ctx: Context, first: Row, table_rows: list[list]) -> Table:
    """The table of per-layer minima across seeds (``first``: any row, for the run's sizes)."""
    return Table(
        "Minimum pairwise distance of last-token states per layer, across random seeds",
        [
            "architecture",
            "layer",
            "seeds",
            "minimum (mean ± std)",
            "smallest",
            "largest",
            "pairs < 1e-6",
            "mean norm",
        ],
        table_rows,
        note=(
            f"{first['prompts']:,} corpus prompts ({first['pairs']:,} pairs) of {ctx.size['max_tokens']} "
            f"tokens, the same for every seed; models of width {ctx.size['hidden']} and {ctx.size['layers']} "
            "blocks, random initialisation only (transformers' own initialiser), float32. Layer 0 (the "
            "embeddings) is left out: prompts ending in the same token share it by construction."
        ),
    )
