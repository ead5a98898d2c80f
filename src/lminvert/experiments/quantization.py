"""Weight quantisation (bitsandbytes int8, NF4, FP4): collision distances per layer against float32, and exact
inversion on the quantised model (states encoded and inverted with the same quantised weights)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from ..collisions import find_collisions
from ..errors import LminvertError
from ..forward import encode
from ..invert import invert
from ..models import LoadedModel
from ..models.quantize import SCHEMES, library_version, quantize, quantized_layers
from .base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group
from .inversion import inversion_cells, inversion_columns
from .measure import result_row
from .prompts import evaluation_prompts

FLOAT = "float32"

LIBRARY_NOTE = (
    "Library: bitsandbytes (0.50.2 when this was written), whose CPU backend quantises and runs all four schemes; "
    "NF4 and FP4 are its own formats. Measured on this 2-core CPU with torch 2.13 (CPU): optimum-quanto 0.2.7 runs "
    "qint8, qint4 and qfloat8 weights on the CPU but has neither NF4 nor FP4 (its qint4 is group-wise affine int4); "
    "torchao 0.18.0 runs Int8WeightOnlyConfig on the CPU and has an NF4 tensor (to_nf4, with double-quantised "
    "scales, a different rounding from bitsandbytes' NF4, and a divisibility constraint on the weight size), but "
    "no FP4 of that definition, and Int4WeightOnlyConfig fails ('Requires mslk >= 1.0.0'). Nothing is "
    "quantised by hand."
)
INT8_NOTE = (
    "int8 is LLM.int8 as transformers' load_in_8bit sets it up (outlier threshold 6.0): the inputs of every linear "
    "layer are quantised to int8 as well, except the feature columns where any row of the matmul exceeds 6.0. Those"
    " columns are chosen over the whole batch (all positions of all prompts), so a position's state depends on "
    "later positions and on the other prompts batched with it: the cached, batched verification no longer "
    "reproduces the full forward's state (measured on SmolLM2: 127x the acceptance tolerance at layer 1, 4,190x at "
    "layer 15), no candidate is accepted, and positions end flagged at the candidate cap; in the collision search "
    "the same prompts encoded again in another batch move by up to a few times the minimum distance between "
    "different prompts (the re-encoding column). int8-t0 (threshold 0, every input int8, row by row) keeps each row"
    " independent, and batched and full forwards usually agree bit for bit; but a float rounding difference "
    "upstream can push an input across an int8 rounding boundary, and the state then jumps (SmolLM2, layer 15, one "
    "20-token code prompt: 0 at 18 positions, 2,210x the tolerance at one), so a few positions end flagged. nf4 and"
    " fp4 quantise weights only (dequantised and multiplied in float32)."
)


def quantized_model(ctx: Context, name: str, scheme: str) -> LoadedModel:
    """``name`` quantised with ``scheme`` (the float model itself for ``float32``), made once per run."""
    base = ctx.load(name)
    if scheme == FLOAT:
        return base

    def make() -> LoadedModel:
        began = time.perf_counter()
        model = quantize(base, scheme)
        ctx.memo[("quantize_seconds", name, scheme)] = time.perf_counter() - began
        return model

    return ctx.once(("quantized", name, scheme), make)


def _prompts(ctx: Context, model: LoadedModel) -> list:
    s = ctx.size
    key = ("prompts", model.name, tuple(s["kinds"]), s["per_kind"], s["length"])
    return ctx.once(key, lambda: evaluation_prompts(model, s["per_kind"], s["length"], ctx.seed, kinds=s["kinds"]))


class Quantization(Experiment):
    name = "quantization"
    title = "Weight quantisation: collision distances and exact inversion with int8, NF4 and FP4 weights"
    paper = (
        "Weight quantisation does not create collisions: it more than doubles the minimum distance between "
        "last-token states. SIPIT stays 100% exact on 4-bit quantised Mistral-7B (32k vocabulary) and Llama-3.1-8B "
        "(128k), checking 0.19% and 0.21% of the vocabulary per position."
    )
    quick_size = {
        "schemes": [FLOAT, *SCHEMES],
        "corpus": "mixed",
        "n_prompts": 48,
        "max_tokens": 8,
        "layers": "all",
        "kinds": ["prose"],
        "per_kind": 1,
        "length": 5,
        "layer": "1",
        "first_table": False,
        "max_candidates": 1280,
    }
    full_size = {
        "schemes": [FLOAT, *SCHEMES],
        "corpus": "mixed",
        "n_prompts": 400,
        "max_tokens": 16,
        "layers": "all",
        "kinds": ["prose", "code"],
        "per_kind": 2,
        "length": 20,
        "layer": "middle",
        "first_table": True,
        "max_candidates": 1024,
    }
    full_duration = (
        "about 25 minutes on SmolLM2 with the CPU to itself (5 x 400 prompts through 30 layers, a first-position "
        "table per quantised model at layer 15, int8 positions checked up to the 1,024-candidate cap); about 3x that "
        "with the CPU shared"
    )

    def units(self, ctx: Context) -> list[Unit]:
        schemes = list(ctx.size["schemes"])
        unknown = [s for s in schemes if s != FLOAT and s not in SCHEMES]
        if unknown:
            raise LminvertError(f"unknown scheme(s) {', '.join(unknown)}: use {', '.join([FLOAT, *SCHEMES])}")
        if FLOAT not in schemes:
            raise LminvertError(f"the schemes must include {FLOAT} (the reference the others are compared with)")
        library_version()  # a missing bitsandbytes is a one-line error before any work
        n = len(ctx.size["kinds"]) * ctx.size["per_kind"]
        units = []
        for model in ctx.models:
            for scheme in schemes:
                params = {"model": model, "scheme": scheme}
                units.append(Unit(f"{model}.{scheme}.collisions", f"{model} {scheme} collisions", params))
            for scheme in schemes:
                for i in range(n):
                    params = {"model": model, "scheme": scheme, "i": i}
                    units.append(Unit(f"{model}.{scheme}.invert{i}", f"{model} {scheme} inversion {i}", params))
        return units

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        name, scheme = unit.params["model"], unit.params["scheme"]
        model = quantized_model(ctx, name, scheme)
        base: Row = {
            "model": name,
            "scheme": scheme,
            "weights_hash": model.weights_hash,
            "quantized_layers": quantized_layers(model),
        }
        seconds = ctx.memo.get(("quantize_seconds", name, scheme))
        if seconds is not None:
            base["quantize_seconds"] = seconds
        if "i" in unit.params:
            return [{**base, "test": "inversion", **self._invert(ctx, name, model, unit.params["i"])}]
        return [{**base, "test": "collisions", **row} for row in self._collisions(ctx, name, scheme, model)]

    def _collisions(self, ctx: Context, name: str, scheme: str, model: LoadedModel) -> list[Row]:
        s = ctx.size
        results = find_collisions(
            model,
            corpus=s["corpus"],
            n_prompts=s["n_prompts"],
            layers=s["layers"],
            max_tokens=s["max_tokens"],
            out=ctx.directory / f"{name}-{scheme}-collisions",
            seed=ctx.seed,
            progress=False,
        )
        return [
            {
                "layer": layer,
                "min_distance": r.min_distance,
                "below_threshold": r.n_below_threshold,
                "nn_median": r.nn_quantiles.get("0.5"),
                "pairs": results.n_pairs,
                # the same prompts encoded again in a batch of their own: rounding (or batch dependence) only
                "rounding_noise_max": r.details.get("rounding_noise", {}).get("max"),
            }
            for layer, r in results.layers.items()
        ]

    def _invert(self, ctx: Context, name: str, model: LoadedModel, i: int) -> Row:
        s = ctx.size
        prompt = _prompts(ctx, ctx.load(name))[i]
        ids = list(prompt.ids)
        layer = model.probe.layer(s["layer"])
        states = encode(model, [ids], layer)
        reference = encode(ctx.load(name), [ids], layer).states[0].double()
        (r,) = invert(
            model,
            states,
            seed=ctx.seed,
            first_table=s["first_table"],
            max_candidates=s["max_candidates"],
        )
        return {
            "prompt": i,
            "kind": prompt.kind,
            **result_row(ids, r),
            "state_shift": float((states.states[0].double() - reference).norm() / reference.norm()),
            "threads": torch.get_num_threads(),
        }

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        tables, figures = [], []
        schemes = list(ctx.size["schemes"])
        quantised = [q for q in schemes if q != FLOAT]
        for (model,), model_rows in group(rows, "model").items():
            minima = {(r["scheme"], r["layer"]): r["min_distance"] for r in model_rows if r["test"] == "collisions"}
            layers = list(dict.fromkeys(r["layer"] for r in model_rows if r["test"] == "collisions"))
            tables.append(_minima_table(ctx, model, minima, layers, quantised))
            tables.append(_ratio_table(model, model_rows, minima, layers, schemes))
            inv = [r for r in model_rows if r["test"] == "inversion"]
            if inv:
                tables.append(_inversion_table(ctx, model, inv))
            figures.append(_minima_figure(model, minima, layers, schemes))
            figures.append(_ratio_figure(model, minima, layers, quantised))
        notes = [LIBRARY_NOTE, f"Measured with {library_version()}.", INT8_NOTE]
        return Summary(tables, figures, notes)


Minima = dict[tuple[str, str], float]  # (scheme, layer) -> minimum pairwise distance


def _ratio(minima: Minima, scheme: str, layer: str) -> float | None:
    """``scheme``'s minimum distance at ``layer`` over float32's (None where either is missing or float32's is 0)."""
    a, b = minima.get((scheme, layer)), minima.get((FLOAT, layer))
    return a / b if a is not None and b else None


def _minima_table(ctx: Context, model: str, minima: Minima, layers: list[str], quantised: list[str]) -> Table:
    """Per layer: float32's minimum distance, then each quantised scheme's and its ratio to float32's."""
    per_layer = []
    for layer in layers:
        cells: list = [layer, minima.get((FLOAT, layer))]
        for q in quantised:
            cells += [minima.get((q, layer)), _ratio(minima, q, layer)]
        per_layer.append(cells)
    columns = ["layer", FLOAT] + [c for q in quantised for c in (q, f"{q} / {FLOAT}")]
    n_prompts, max_tokens = ctx.size["n_prompts"], ctx.size["max_tokens"]
    return Table(
        f"{model}: minimum pairwise distance of last-token states per layer ({n_prompts} prompts)",
        columns,
        per_layer,
        note=(
            f"The same {n_prompts} prompts (corpus {ctx.size['corpus']}, up to {max_tokens} tokens) "
            "through every model; exact minimum over all pairs, float64 re-measured."
        ),
    )


def _ratio_row(scheme: str, model_rows: Sequence[Row], minima: Minima, layers: list[str]) -> list:
    """One scheme over all layers: collisions, smallest minimum, ratios to float32, re-encoding difference."""
    coll = [r for r in model_rows if r["test"] == "collisions" and r["scheme"] == scheme]
    ratios = [x for x in (_ratio(minima, scheme, layer) for layer in layers) if x is not None]
    noise = [
        r["rounding_noise_max"] / r["min_distance"]
        for r in coll
        if r.get("rounding_noise_max") is not None and r["min_distance"] > 0
    ]
    quantised = scheme != FLOAT
    return [
        scheme,
        sum(r["below_threshold"] for r in coll),
        min(r["min_distance"] for r in coll) if coll else None,
        min(ratios) if ratios and quantised else None,
        statistics.median(ratios) if ratios and quantised else None,
        max(ratios) if ratios and quantised else None,
        f"{sum(x >= 2 for x in ratios)}/{len(ratios)}" if quantised else "-",
        max(noise) if noise else None,
        coll[0]["quantized_layers"] if coll else None,
    ]


def _ratio_table(model: str, model_rows: Sequence[Row], minima: Minima, layers: list[str], schemes: list[str]) -> Table:
    """One row per scheme over all layers (:func:`_ratio_row`), then the paper's claim."""
    summary_rows = [_ratio_row(q, model_rows, minima, layers) for q in schemes]
    summary_rows.append(["paper (its models)", 0, None, None, "> 2", None, "-", None, None])
    return Table(
        f"{model}: collisions and the ratio to {FLOAT}, over all layers",
        [
            "scheme",
            "pairs under 1e-6",
            "smallest minimum",
            "min ratio",
            "median ratio",
            "max ratio",
            "layers with ratio >= 2",
            "re-encoding difference / minimum (worst layer)",
            "quantised linear layers",
        ],
        summary_rows,
        note=(
            "Ratio: a scheme's minimum distance at a layer over float32's at the same layer. Re-encoding "
            "difference: the largest distance between a prompt's stored state and the same prompt encoded "
            "again in a batch of its own (16 prompts), over the layer's minimum distance; 0 means the "
            "state does not depend on what it was batched with."
        ),
    )


def _inversion_table(ctx: Context, model: str, inv: list[Row]) -> Table:
    """Inversion on each scheme's model (the rows of its ``inversion`` units), then the paper's results."""
    inv_rows = []
    for (q,), rs in group(inv, "scheme").items():
        flagged = sum(r["uncertain"] for r in rs)
        positions = sum(r["length"] for r in rs)
        shift = statistics.fmean(r["state_shift"] for r in rs)
        inv_rows.append([q, *inversion_cells(rs), f"{flagged}/{positions}", shift])
    inv_rows.append(["paper: 4-bit Mistral-7B", "1.00", "-", "-", "-", "-", "0.19%", "-", "-"])
    inv_rows.append(["paper: 4-bit Llama-3.1-8B", "1.00", "-", "-", "-", "-", "0.21%", "-", "-"])
    layer = inv[0]["layer"]
    table_note = (
        f"States of every position at layer {layer}, encoded and inverted with the same (quantised) model; "
        f"linear policy, first-position table {'on' if ctx.size['first_table'] else 'off'}, at most "
        f"{ctx.size['max_candidates']:,} candidates per position (a position not accepted by then is "
        "flagged). State shift: ||h_q - h_float32|| / ||h_float32|| over the prompt's states."
    )
    if ctx.quick:
        table_note += (
            " Quick size: layer 1 without the first-position table, because building that table for each "
            "quantised model at a middle layer (a forward of every vocabulary token) takes minutes."
        )
    return Table(
        f"{model}: inversion at layer {layer}, {inv[0]['length']}-token prompts",
        ["scheme", *inversion_columns(), "flagged positions", "state shift"],
        inv_rows,
        note=table_note,
    )


def _minima_figure(model: str, minima: Minima, layers: list[str], schemes: list[str]) -> FigureSpec:
    """Minimum distance per (numeric) layer, one line per scheme."""
    series = []
    for q in schemes:
        numeric = [layer for layer in layers if layer.isdigit() and (q, layer) in minima]
        series.append(Series(q, [int(x) for x in numeric], [minima[(q, x)] for x in numeric]))
    return FigureSpec(
        f"{model}-quantization-minima",
        f"{model}: minimum distance between last-token states per layer, one line per weight format "
        "(log scale; the collision threshold is 1e-6); a line above float32's means quantisation widened "
        "the gaps.",
        title="Minimum distance per layer by weight format",
        xlabel="layer",
        ylabel="minimum L2 distance",
        series=series,
        logy=True,
    )


def _ratio_figure(model: str, minima: Minima, layers: list[str], quantised: list[str]) -> FigureSpec:
    """Each quantised scheme's minimum distance over float32's per (numeric) layer, with the paper's 2x line."""
    ratio_series = []
    for q in quantised:
        numeric = [layer for layer in layers if layer.isdigit() and _ratio(minima, q, layer) is not None]
        ratio_series.append(Series(q, [int(x) for x in numeric], [_ratio(minima, q, x) for x in numeric]))
    return FigureSpec(
        f"{model}-quantization-ratio",
        f"{model}: each format's minimum distance over float32's, per layer (log scale); the line at 2 "
        "is the paper's 'more than doubles'.",
        title=f"Minimum distance relative to {FLOAT}",
        xlabel="layer",
        ylabel=f"minimum distance / {FLOAT}",
        series=ratio_series,
        logy=True,
        hline=2.0,
        hline_label="paper: > 2x",
    )
