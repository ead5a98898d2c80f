"""The audit's tables, heatmaps and one sentence of verdict per (leak, layer), from its rows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..experiments.base import Context, FigureSpec, Row, Series, Summary, Table, fmt, group

LEAK_TITLES = {
    "states": "every position's state (split inference, activation logs)",
    "kv": "a block's KV cache (keys after the rotary embedding)",
    "last": "the last position's state only (an embedding API)",
}


def recovery(rows: Sequence[Row]) -> float:
    """Tokens recovered at their positions, over all tokens of the prompts."""
    return sum(r["right"] for r in rows) / max(sum(r["length"] for r in rows), 1)


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _cell(rows: Sequence[Row]) -> str:
    exact = sum(r["exact"] for r in rows)
    return f"{100 * recovery(rows):.0f}% ({exact}/{len(rows)})"


def _ratio(rows: Sequence[Row]) -> float | None:
    """The median over positions of the perturbation's norm over half the gap (where both are known)."""
    ratios = []
    for r in rows:
        for delta, gap in zip(r["perturbation"], r["half_gap"], strict=True):
            if gap and delta is not None:  # None: a missing position
                ratios.append(delta / gap)
    return statistics.median(ratios) if ratios else None


def _sentence(leak: str, layer: str, by_defence: dict[str, list[Row]]) -> str:
    leaking = [d for d, rs in by_defence.items() if recovery(rs) == 1.0]
    stopping = [(d, rs) for d, rs in by_defence.items() if not all(r["exact"] for r in rs)]
    text = f"{leak} at layer {layer}: "
    text += f"{', '.join(leaking)} leak every token" if leaking else "no defence leaks every token"
    if stopping and leak != "last":
        costs = [
            f"{d} ({100 * recovery(rs):.0f}% of tokens recovered, top-1 agreement "
            f"{100 * _mean([r['top1'] for r in rs]):.1f}%)"
            for d, rs in stopping
        ]
        text += "; exact recovery stops under " + ", ".join(costs)
    return text + "."


def summarise(ctx: Context, rows: Sequence[Row]) -> Summary:
    tables, figures, notes = [], [], []
    for (leak,), leak_rows in group(rows, "leak").items():
        defences = list(dict.fromkeys(r["defence"] for r in leak_rows))
        by_layer = group(leak_rows, "layer")
        matrix = []
        for (layer,), layer_rows in by_layer.items():
            by_defence = {d: rs for (d,), rs in group(layer_rows, "defence").items()}
            cells = [_cell(by_defence[d]) if d in by_defence else "-" for d in defences]
            utilities = [fmt(_mean([r["top1"] for r in by_defence.get(d, [])])) for d in defences]
            matrix.append([layer, *cells])
            matrix.append([f"{layer} utility (top-1)", *utilities])
            notes.append(_sentence(leak, layer, by_defence))
        tables.append(
            Table(
                f"Leak matrix, {leak}: {LEAK_TITLES.get(leak, leak)}",
                ["layer", *defences],
                matrix,
                note="Cells: tokens recovered at their positions (exact prompts / prompts); below each layer, the "
                "deployment's top-1 next-token agreement with the undefended model when it computes with what the "
                "defence leaves it.",
            )
        )
        details = []
        for (layer, defence), rs in group(leak_rows, "layer", "defence").items():
            verdicts = {v: sum(r["verdicts"][v] for r in rs) for v in ("certified", "confident", "uncertain")}
            dloss = _mean([r["dloss"] for r in rs])
            details.append(
                [
                    layer, defence, f"{100 * recovery(rs):.1f}%", sum(r["exact"] for r in rs),
                    verdicts["certified"], verdicts["confident"], verdicts["uncertain"],
                    sum(r["wrong_claimed"] for r in rs), statistics.median(r["seconds"] for r in rs),
                    fmt(_mean([r["checked_mean"] for r in rs])), fmt(_ratio(rs)), fmt(dloss),
                    rs[0]["route"],
                ]
            )  # fmt: skip
        tables.append(
            Table(
                f"Details, {leak}",
                [
                    "layer",
                    "defence",
                    "tokens",
                    "exact",
                    "certified",
                    "confident",
                    "uncertain",
                    "wrong, claimed",
                    "median s / prompt",
                    "cand./pos.",
                    "median ‖δ‖/(Δ/2)",
                    "Δ next-token loss",
                    "attack",
                ],
                details,
                note="'wrong, claimed': tokens stated certified or confident that are wrong (never any). ‖δ‖: the "
                "defence's perturbation of a position's row; Δ/2: half the distance from the chosen candidate's row "
                "to the nearest other verified one (Theorem 3.2's radius where the whole vocabulary was verified, an "
                "upper bound on it elsewhere). Attack: engine (lminvert.invert), rows (search in the shipped rows' "
                "space), last (nearest first-position state).",
            )
        )
        layers = [layer for (layer,) in by_layer]
        series = [
            Series(
                f"layer {layer}",
                defences,
                [
                    recovery([r for r in rs if r["defence"] == d])
                    if any(r["defence"] == d for r in rs)
                    else float("nan")
                    for d in defences
                ],
            )
            for (layer,), rs in by_layer.items()
        ]
        figures.append(
            FigureSpec(
                f"audit_{leak}",
                f"Tokens recovered from {LEAK_TITLES.get(leak, leak)}, by layer (rows) and defence (columns).",
                kind="heatmap",
                title=f"Leak matrix: {leak} (layers {', '.join(layers)})",
                xlabel="defence",
                ylabel="layer",
                series=series,
            )
        )
    return Summary(tables, figures, notes)
