"""The layerwise collision figure (the paper's boxplots) with the exhaustive test's figure beside it."""

from __future__ import annotations

from collections.abc import Sequence

from ..collisions import exhaustive_test, find_collisions, prefixes_from_collisions
from ..report import render
from .base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group, minima_figure

PAPER_MINIMA = [  # minimum distance at layer 1 / L/2 / L over ~5e9 pairs
    ("Llama-3.1-8B", 0.001, 0.129, 0.620),
    ("Mistral-7B", 0.002, 0.187, 1.274),
    ("Phi-4-mini", 0.014, 1.336, 9.020),
    ("TinyStories-33M", 0.029, 1.434, 2.793),
]


class Layers(Experiment):
    name = "layers"
    title = "Collisions per layer: minimum and nearest-neighbour distances, and the exhaustive test"
    paper = (
        "About 100k prompts, all pairwise distances of last-token states at every layer (~5e9 pairs), six models, "
        "threshold 1e-6: no collision; the minimum grows with depth (e.g. Llama-3.1-8B 0.001 / 0.129 / 0.620 at layer "
        "1 / L/2 / L). Exhaustive test: every vocabulary token appended to the closest prefixes: no collision."
    )
    quick_size = {
        "n_prompts": 200,
        "max_tokens": 12,
        "corpus": "mixed",
        "layers": "all",
        "exhaustive_prefixes": 0,  # |V| continuations through every layer: minutes, full size only
        "exhaustive_layers": "1,middle,-1",
    }
    full_size = {
        "n_prompts": 2000,
        "max_tokens": 32,
        "corpus": "mixed",
        "layers": "all",
        "exhaustive_prefixes": 1,
        "exhaustive_layers": "1,middle,-1",
    }
    full_duration = (
        "about 17 minutes on SmolLM2 on one shared thread (2,000 prompts at all 30 layers: 12 minutes; then 1 prefix "
        "x 49,152 tokens at 3 layers: 5 minutes)"
    )

    def units(self, ctx: Context) -> list[Unit]:
        units = []
        for model in ctx.models:
            units.append(
                Unit(f"{model}.collisions", f"{model} collision search", {"model": model, "step": "collisions"})
            )
            if ctx.size["exhaustive_prefixes"]:
                units.append(Unit(f"{model}.exhaustive", f"{model} exhaustive test", {"model": model, "step": "exh"}))
        return units

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        s, model_name = ctx.size, unit.params["model"]
        model = ctx.load(model_name)
        collisions_dir = ctx.directory / f"{model_name}-collisions"
        results = find_collisions(
            model,
            corpus=s["corpus"],
            n_prompts=s["n_prompts"],
            layers=s["layers"],
            max_tokens=s["max_tokens"],
            out=collisions_dir,
            seed=ctx.seed,
            progress=False,
        )  # resumes (nothing recomputed) when the exhaustive unit needs it again
        if unit.params["step"] == "collisions":
            render(results)
            return [
                {
                    "model": model_name,
                    "test": "collisions",
                    "layer": name,
                    "min_distance": r.min_distance,
                    "below_threshold": r.n_below_threshold,
                    "nn_median": r.nn_quantiles.get("0.5"),
                    "pairs": results.n_pairs,
                    "figure": f"{model_name}-collisions/nn_distances.png",
                }
                for name, r in results.layers.items()
            ]
        prefixes = prefixes_from_collisions(collisions_dir, s["exhaustive_prefixes"])
        exhaustive = exhaustive_test(
            model,
            prefixes,
            layers=s["exhaustive_layers"],
            out=ctx.directory / f"{model_name}-exhaustive",
            seed=ctx.seed,
            progress=False,
        )
        render(exhaustive)
        return [
            {
                "model": model_name,
                "test": "exhaustive",
                "layer": name,
                "min_distance": r["min_distance"],
                "below_threshold": r["n_below_threshold"],
                "pairs": exhaustive.n_pairs,
                "min_distance_inputs_differ": r["min_distance_inputs_differ"],
                "below_threshold_inputs_differ": r["n_below_threshold_inputs_differ"],
                "figure": f"{model_name}-exhaustive/nn_distances.png",
            }
            for name, r in exhaustive.layers.items()
        ]

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        tables, figures, series = [], [], []
        for (model, test), rs in group(rows, "model", "test").items():
            tables.append(_layer_table(model, test, rs))
            what = "corpus prompts" if test == "collisions" else "all one-token continuations of the closest prefixes"
            figures.append(
                FigureSpec(
                    f"{model}-{test}",
                    f"{model}, {what}: nearest-neighbour distances per layer (boxes) and the exact "
                    "minimum (red): look at whether the minimum stays above the 1e-6 threshold at every layer.",
                    kind="file",
                    path=rs[0]["figure"],
                )
            )
            if test == "collisions":
                numeric = [r for r in rs if r["layer"].isdigit()]
                series.append(Series(model, [int(r["layer"]) for r in numeric], [r["min_distance"] for r in numeric]))
        tables.append(
            Table(
                "The paper's minima (its models, ~5e9 pairs)",
                ["model", "layer 1", "layer L/2", "layer L"],
                [list(p) for p in PAPER_MINIMA],
                note=(
                    "Different models and far more pairs than ours: compare the trend (growth with depth, no "
                    "collision), not the values. A minimum over more pairs can only be smaller."
                ),
            )
        )
        figures.append(
            minima_figure(
                "layer_minima",
                "Minimum pairwise distance per layer (log scale): look at whether it grows with depth as in the paper.",
                title="Minimum distance against depth",
                xlabel="layer",
                series=series,
            )
        )
        return Summary(tables, figures)


def _layer_table(model: str, test: str, rs: Sequence[Row]) -> Table:
    """One model's per-layer minima: over corpus prompts (``test`` "collisions") or the exhaustive next-token test."""
    if test == "collisions":
        return Table(
            f"{model}: corpus prompts",
            ["layer", "minimum distance", "pairs under 1e-6", "median nearest-neighbour distance", "pairs"],
            [[r["layer"], r["min_distance"], r["below_threshold"], r.get("nn_median"), r["pairs"]] for r in rs],
        )
    columns = ["layer", "minimum distance", "pairs under 1e-6", "minimum, inputs differ"]
    columns += ["pairs under 1e-6, inputs differ", "pairs per prefix"]
    keys = ["layer", "min_distance", "below_threshold", "min_distance_inputs_differ", "below_threshold_inputs_differ"]
    return Table(
        f"{model}: exhaustive next-token test",
        columns,
        [[*(r[k] for k in keys), r["pairs"]] for r in rs],
        note=(
            "Tokens whose embedding rows are bit-identical give identical states by construction (zero "
            "distance, not a failure of injectivity, which concerns distinct inputs); 'inputs differ' "
            "excludes those pairs."
        ),
    )
