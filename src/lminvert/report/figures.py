"""Figures, drawn with matplotlib's object API (no pyplot, no global backend switch: safe inside a user's
notebook or GUI session).

* :func:`plot_nn_distances` - the layerwise figure: nearest-neighbour distances per layer, log scale, minima marked.
* :func:`plot_spec` - an experiment's line or bar figure from its specification.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..paths import atomic_file

_BOXES = {
    "boxprops": {"facecolor": "#c6dbef", "edgecolor": "#3182bd"},
    "medianprops": {"color": "#08519c"},
    "whiskerprops": {"color": "#3182bd"},
    "capprops": {"color": "#3182bd"},
}


def plot_nn_distances(
    layers: Sequence[str],
    nn: Sequence[np.ndarray],
    minima: Sequence[float],
    path: str | Path,
    threshold: float | None = None,
    title: str = "",
    unit: str = "prompts",
    second_minima: Sequence[float | None] | None = None,
    second_label: str = "",
) -> Path:
    """Box plot per layer (whiskers 1%-99%, box 25%-75%, median) on a log axis; exact minima as red marks.

    Zero distances (collisions) cannot sit on a log axis: they are drawn at the bottom edge and counted in the
    legend. ``second_minima`` (e.g. the minimum over pairs whose inputs differ) are drawn as hollow marks.
    """
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    positive = [v[v > 0] for v in (np.asarray(x, dtype=np.float64) for x in nn)]
    floor_candidates = [float(v.min()) for v in positive if len(v)] + [m for m in minima if m > 0]
    if threshold:
        floor_candidates.append(threshold)
    floor = (min(floor_candidates) if floor_candidates else 1e-6) / 3
    n_zero = sum(int(np.count_nonzero(np.asarray(x) == 0)) for x in nn)
    width = max(7.0, min(16.0, 0.45 * len(layers) + 3))
    fig = Figure(figsize=(width, 4.6))
    ax = fig.subplots()
    xs = np.arange(len(layers))
    data = [v if len(v) else np.array([floor]) for v in positive]
    ax.boxplot(data, positions=xs, whis=(1, 99), showfliers=False, widths=0.6, patch_artist=True, **_BOXES)
    shown_min = [m if m > 0 else floor for m in minima]
    ax.plot(xs, shown_min, "v", color="#de2d26", markersize=7, label="minimum over all pairs (exact)", zorder=3)
    if len(xs) > 1:
        ax.plot(xs, shown_min, "-", color="#de2d26", linewidth=0.8, alpha=0.6)
    if second_minima is not None:
        shown = [(x, m) for x, m in zip(xs, second_minima, strict=True) if m is not None and m > 0]
        if shown:
            ax.plot(*zip(*shown, strict=True), "o", mfc="none", color="#de2d26", markersize=7, label=second_label)
    if threshold:
        ax.axhline(threshold, color="#636363", linestyle="--", linewidth=1, label=f"collision threshold {threshold:g}")
    if n_zero:
        ax.plot([], [], " ", label=f"{n_zero} zero distances drawn at the bottom")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 1.5)
    ax.set_xticks(xs)
    ax.set_xticklabels(list(layers), rotation=0 if len(layers) <= 16 else 90)
    ax.set_xlabel(f"layer (boxes: 25-75% of {unit}, whiskers: 1-99%)")
    ax.set_ylabel("nearest-neighbour L2 distance")
    return _save(fig, ax, title, path)


def _write(fig: Any, path: Path) -> Path:
    """The figure laid out and written atomically to ``path`` (its format from the suffix)."""
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=130, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
    return path


def _save(fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Title, grid and a legend below the axes, then :func:`_write`."""
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    return _write(fig, path)


def plot_spec(spec: Mapping[str, Any], path: str | Path) -> Path:
    """Draw a :class:`lminvert.experiments.base.FigureSpec` (as its JSON dict): ``line``, ``bar`` or ``heatmap`` (one
    series per row, its ``x`` the columns, values in 0..1 shown as percentages)."""
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series = list(spec.get("series", []))
    fig = Figure(figsize=(7.5, 4.4))
    ax = fig.subplots()
    if spec.get("kind") == "heatmap":
        _heatmap(fig, ax, series)
    elif spec.get("kind") == "bar":
        categories = list(dict.fromkeys(str(x) for s in series for x in s["x"]))
        width = 0.8 / max(len(series), 1)
        for i, s in enumerate(series):
            xs = np.array([categories.index(str(x)) for x in s["x"]], dtype=float) + (i - (len(series) - 1) / 2) * width
            ax.bar(xs, s["y"], width=width, yerr=s.get("yerr"), label=s["label"], capsize=3)
        ax.set_xticks(np.arange(len(categories)))
        ax.set_xticklabels(categories, rotation=0 if len(categories) <= 8 else 45, ha="center")
    else:
        for s in series:
            ax.errorbar(s["x"], s["y"], yerr=s.get("yerr"), marker="o", markersize=4, capsize=3, label=s["label"])
    if spec.get("kind") != "bar" and all(isinstance(x, int) for s in series for x in s["x"]):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if spec.get("logx"):
        ax.set_xscale("log")
    if spec.get("logy"):
        ax.set_yscale("log")
    if spec.get("hline") is not None:
        ax.axhline(spec["hline"], color="#636363", linestyle="--", linewidth=1, label=spec.get("hline_label") or None)
    ax.set_xlabel(spec.get("xlabel", ""))
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.set_title("\n".join(textwrap.wrap(spec.get("title", ""), 90)), fontsize=9)
    ax.grid(alpha=0.3)
    if spec.get("kind") == "heatmap":
        ax.grid(False)
    elif any(s.get("label") for s in series) or spec.get("hline_label"):
        ax.legend(fontsize=8, frameon=False)
    return _write(fig, path)


def _heatmap(fig: Any, ax: Any, series: Sequence[Mapping[str, Any]]) -> None:
    columns = [str(x) for x in series[0]["x"]] if series else []
    values = np.array([[np.nan if v is None else float(v) for v in s["y"]] for s in series], dtype=float)
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="Reds", aspect="auto")
    for (i, j), value in np.ndenumerate(values):
        if not np.isnan(value):
            ax.text(j, i, f"{100 * value:.0f}%", ha="center", va="center", fontsize=8,
                    color="white" if value > 0.6 else "black")  # fmt: skip
    ax.set_xticks(np.arange(len(columns)))
    ax.set_xticklabels(columns, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(np.arange(len(series)))
    ax.set_yticklabels([s["label"] for s in series])
    fig.colorbar(image, ax=ax, label="tokens recovered")
