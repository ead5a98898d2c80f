"""The audit's tables, heatmaps and one sentence of verdict per (leak, layer), from its rows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..experiments.base import Context, FigureSpec, Row, Series, Summary, Table, group
from ..report.text import fmt

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


MATRIX_NOTE = (
    "Cells: tokens recovered at their positions (exact prompts / prompts); below each layer, the deployment's top-1 "
    "next-token agreement with the undefended model when it computes with what the defence leaves it."
)
DETAILS_NOTE = (
    "'wrong, claimed': tokens stated certified or confident that are wrong (0 is the contract; any other count is a "
    "bug to report). ‖δ‖: the defence's perturbation of a position's row; Δ/2: half the distance from the chosen "
    "candidate's row to the nearest other verified one (Theorem 3.2's radius where the whole vocabulary was verified, "
    "an upper bound on it elsewhere). Attack: engine (lminvert.invert), rows (search in the shipped rows' space), last "
    "(a search for whole prompts, as lminvert invert --leak last), last-table (the last token guessed from the "
    "first-position table, where a projection or permutation leaves no prompt's state to compare)."
)
DETAILS = ["layer", "defence", "tokens", "exact", "certified", "confident", "uncertain", "wrong, claimed"]
DETAILS += ["median s / prompt", "cand./pos.", "median ‖δ‖/(Δ/2)", "Δ next-token loss", "attack"]


def _matrix(leak: str, defences: list[str], by_layer: dict[tuple, list[Row]]) -> tuple[Table, list[str]]:
    """The leak's matrix (layers x defences) and a verdict sentence per layer."""
    matrix, notes = [], []
    for (layer,), layer_rows in by_layer.items():
        by_defence = {d: rs for (d,), rs in group(layer_rows, "defence").items()}
        matrix.append([layer, *(_cell(by_defence[d]) if d in by_defence else "-" for d in defences)])
        matrix.append(
            [f"{layer} utility (top-1)", *(fmt(_mean([r["top1"] for r in by_defence.get(d, [])])) for d in defences)]
        )
        notes.append(_sentence(leak, layer, by_defence))
    title = f"Leak matrix, {leak}: {LEAK_TITLES.get(leak, leak)}"
    return Table(title, ["layer", *defences], matrix, note=MATRIX_NOTE), notes


def _details(leak: str, leak_rows: Sequence[Row]) -> Table:
    details = []
    for (layer, defence), rs in group(leak_rows, "layer", "defence").items():
        verdicts = [sum(r["verdicts"][v] for r in rs) for v in ("certified", "confident", "uncertain")]
        details.append(
            [
                layer, defence, f"{100 * recovery(rs):.1f}%", sum(r["exact"] for r in rs), *verdicts,
                sum(r["wrong_claimed"] for r in rs), statistics.median(r["seconds"] for r in rs),
                fmt(_mean([r["checked_mean"] for r in rs])), fmt(_ratio(rs)), fmt(_mean([r["dloss"] for r in rs])),
                rs[0]["route"],
            ]
        )  # fmt: skip
    return Table(f"Details, {leak}", DETAILS, details, note=DETAILS_NOTE)


def _heatmap(leak: str, defences: list[str], by_layer: dict[tuple, list[Row]]) -> FigureSpec:
    series = []
    for (layer,), rs in by_layer.items():
        cells = {d: recovery(x) for (d,), x in group(rs, "defence").items()}
        series.append(Series(f"layer {layer}", defences, [cells.get(d) for d in defences]))
    layers = ", ".join(layer for (layer,) in by_layer)
    return FigureSpec(
        f"audit_{leak}",
        f"Tokens recovered from {LEAK_TITLES.get(leak, leak)}, by layer (rows) and defence (columns).",
        kind="heatmap",
        title=f"Leak matrix: {leak} (layers {layers})",
        xlabel="defence",
        ylabel="layer",
        series=series,
    )


def summarise(ctx: Context, rows: Sequence[Row]) -> Summary:
    """Per leak: its matrix, its details and its heatmap; a verdict sentence per leak and layer."""
    tables, figures, notes = [], [], []
    for (leak,), leak_rows in group(rows, "leak").items():
        defences = list(dict.fromkeys(r["defence"] for r in leak_rows))
        by_layer = group(leak_rows, "layer")
        matrix, sentences = _matrix(leak, defences, by_layer)
        tables += [matrix, _details(leak, leak_rows)]
        notes += sentences
        figures.append(_heatmap(leak, defences, by_layer))
    return Summary(tables, figures, notes)
