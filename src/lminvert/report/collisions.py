"""Rendering collision and exhaustive runs: results.md, the layerwise figure, and the CLI's summary lines.

Everything here reads finished results (and the nearest-neighbour arrays their run directory holds); nothing
here computes a distance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..collisions.exhaustive import ExhaustiveResults
from ..collisions.results import CollisionResults, LayerResult
from .figures import plot_nn_distances

FIGURE = "nn_distances.png"
MARKDOWN = "results.md"


def _snippet(text: str, width: int = 60) -> str:
    quoted = json.dumps(text, ensure_ascii=False)[1:-1].replace("|", "\\|")
    return quoted if len(quoted) <= width else "…" + quoted[-(width - 1) :]


def _g(value: float) -> str:
    return f"{value:.4g}"


def layer_table(layers: dict[str, LayerResult], threshold: float, k: int) -> list[str]:
    lines = [
        f"| layer | min distance | {k}th closest | pairs < {threshold:g} | rounding noise | NN 1% | NN median "
        "| NN 99% | re-measured (float64) | search s | pairs/s | matmul fraction |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in layers.items():
        q, s = r.nn_quantiles, r.search
        kth = r.closest_pairs[-1].distance if r.closest_pairs else float("nan")
        noise = r.details.get("rounding_noise", {}).get("max", float("nan"))
        lines.append(
            f"| {name} | {_g(r.min_distance)} | {_g(kth)} | {r.n_below_threshold} | {_g(noise)} | {_g(q['0.01'])} "
            f"| {_g(q['0.5'])} "
            f"| {_g(q['0.99'])} | {s.get('n_exact', 0)} | {s.get('seconds', 0):.2f} "
            f"| {s.get('pairs_per_second', 0):.3g} | {s.get('matmul_fraction', float('nan')):.2f} |"
        )
    return lines


def closest_lines(layers: dict[str, LayerResult], shown: int = 3) -> list[str]:
    lines = []
    for name, r in layers.items():
        lines.append(f"\n**layer {name}**\n")
        for p in r.closest_pairs[:shown]:
            tied = " (identical inputs: the ids differ only in tokens with identical embedding rows)" * p.same_input
            lines.append(f"- {p.distance:.6g}: `{_snippet(p.a_text)}` vs `{_snippet(p.b_text)}`{tied}")
    return lines


def collisions_markdown(results: CollisionResults, figure: str | None = None) -> str:
    c = results.config
    extra = results.extra
    tp = extra.get("throughput", {})
    lines = [
        f"# Collision search: {results.model}",
        "",
        f"{results.n_prompts} distinct prompts from corpus `{c.corpus}` (windows of up to {c.max_tokens} tokens, "
        f"seed {c.seed}), {results.n_pairs:,} pairs per layer. Distances are L2 between last-token states "
        "(layer l = residual stream after block l, no final norm), exact in float64; a collision is a pair "
        f"closer than {c.threshold:g}.",
        "",
        *layer_table(results.layers, c.threshold, c.k),
        "",
        f"Throughput: {results.pairs_per_second:.3g} pairs/s over all layers = "
        f"{tp.get('achieved_flops_per_second', 0) / 1e9:.1f} GFLOP/s of pair distances (2·d flops per pair), "
        f"{results.matmul_fraction:.0%} of this machine's float32 matmul "
        f"({tp.get('matmul_flops_per_second', 0) / 1e9:.1f} GFLOP/s, torch.mm of the tile shape, same run). "
        f"Peak memory {extra.get('memory_peak_mb', 0):.0f} MiB.",
        "",
        "NN = each prompt's nearest-neighbour distance (quantiles over prompts); 're-measured' counts the pairs the "
        "GEMM's rigorous error bound could not rule out, measured again in float64. 'Rounding noise' is the largest "
        "distance between a stored state and the same prompt encoded again in another batch: the same function of "
        "the same input, so distances at that scale cannot be told from rounding.",
    ]
    if figure:
        lines += ["", f"![nearest-neighbour distances per layer]({figure})"]
    lines += ["", "## Closest pairs", *closest_lines(results.layers)]
    return "\n".join(lines) + "\n"


def exhaustive_markdown(results: ExhaustiveResults, figure: str | None = None) -> str:
    c = results.config
    lines = [
        f"# Exhaustive next-token test: {results.model}",
        "",
        f"For each prefix, all {results.vocab_size} one-token continuations; {results.n_pairs:,} pairs per prefix "
        f"and layer, exact minimum in float64; collision threshold {c.threshold:g}.",
        "",
        f"Throughput: {results.pairs_per_second:.3g} pairs/s, {results.matmul_fraction:.0%} of this machine's "
        "float32 matmul (same run).",
    ]
    for p in results.prefixes:
        shown = p.text if len(p.text) <= 80 else "…" + p.text[-79:]
        lines += ["", f"## prefix {p.index}: `{shown!r}` ({len(p.ids)} tokens)", ""]
        lines += layer_table(p.layers, c.threshold, c.k)
        lines.append("")
        for name, r in p.layers.items():
            differ, tied = r.details.get("inputs_differ", {}), r.details.get("tied_tokens", {})
            if r.closest_pairs:
                best = r.closest_pairs[0]
                lines.append(
                    f"- layer {name}: closest continuations {best.a_index} {best.a_text.rsplit('⟨', 1)[-1][:-1]!r} and "
                    f"{best.b_index} {best.b_text.rsplit('⟨', 1)[-1][:-1]!r} at {best.distance:.6g}"
                    + (" (identical embedding rows)" if best.same_input else "")
                )
            if tied.get("n_pairs"):
                lines.append(
                    f"  - {tied['n_pairs']} pairs of tokens with identical embedding rows (identical inputs): "
                    f"{tied['n_below_threshold']} under {c.threshold:g}, the rest within {tied['max_distance']:.3g} "
                    "(rounding); pairs whose inputs differ: minimum "
                    + (f"{differ['min_distance']:.6g}" if differ.get("min_distance") is not None else "not tracked")
                    + f", {differ.get('n_below_threshold', 0)} under {c.threshold:g}"
                )
    if figure:
        lines += ["", f"![nearest-neighbour distances per layer]({figure})"]
    return "\n".join(lines) + "\n"


def _nn_arrays(results: CollisionResults | ExhaustiveResults) -> tuple[list[str], list[np.ndarray]]:
    """Layer names and, per layer, the NN distances pooled over the run's stores (read from its directory)."""
    names = list(results.config.layers)
    root = Path(results.directory)
    nn = results.files.get("nn", {})
    return names, [np.concatenate([np.load(root / path) for path in nn[name]]) for name in names]


def _render(results: CollisionResults | ExhaustiveResults, figure: bool, markdown: str, **plot) -> dict[str, str]:
    root = Path(results.directory)
    paths = {}
    if figure:
        names, nn = _nn_arrays(results)
        by_layer = results.layer_minima()
        minima = [by_layer[name][0] for name in names]
        figure_path = plot_nn_distances(names, nn, minima, root / FIGURE, results.config.threshold, **plot)
        paths["figure"] = str(figure_path)
    target = root / MARKDOWN
    target.write_text(markdown, encoding="utf-8")
    return {"markdown": str(target), **paths}


def render_collisions(results: CollisionResults, figure: bool = True) -> dict[str, str]:
    """Write results.md (and the figure) into the run's directory; returns the paths written."""
    title = (
        f"{results.model}: nearest-neighbour distance of {results.n_prompts} prompts' last-token states "
        f"({results.config.corpus})"
    )
    return _render(results, figure, collisions_markdown(results, FIGURE if figure else None), title=title)


def render_exhaustive(results: ExhaustiveResults, figure: bool = True) -> dict[str, str]:
    """Write results.md (and the figure) into the run's directory; returns the paths written."""
    title = (
        f"{results.model}: nearest-neighbour distance among all {results.vocab_size} one-token continuations "
        f"({len(results.prefixes)} prefix(es))"
    )
    return _render(
        results,
        figure,
        exhaustive_markdown(results, FIGURE if figure else None),
        title=title,
        unit="continuations",
        second_minima=[row["min_distance_inputs_differ"] for row in results.layers.values()],
        second_label="minimum over pairs whose inputs differ (tied tokens aside)",
    )


def summary_lines(results: CollisionResults | ExhaustiveResults) -> list[str]:
    """What the CLI prints after a run: the headline, one line per layer, throughput."""
    threshold = results.config.threshold
    if isinstance(results, CollisionResults):
        head = (
            f"{results.model}: {results.n_prompts} prompts, {results.n_pairs:,} pairs per layer, "
            f"corpus {results.config.corpus}"
        )
    else:
        head = (
            f"{results.model}: {len(results.prefixes)} prefix(es) x {results.vocab_size} continuations, "
            f"{results.n_pairs:,} pairs per prefix and layer"
        )
    lines = [head]
    minima = results.layer_minima()
    for name, (distance, below) in minima.items():
        lines.append(f"  layer {name:>5}: min distance {distance:.6g}, {below} pair(s) under {threshold:g}")
    total = sum(below for _, below in minima.values())
    lines.append(
        f"{total} pair(s) under {threshold:g}; {results.pairs_per_second:.3g} pairs/s, "
        f"{results.matmul_fraction:.0%} of this machine's float32 matmul"
    )
    return lines
