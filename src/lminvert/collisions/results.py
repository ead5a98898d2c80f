"""Configs and results of the collision search, and their files: results.json and results.md.

``results.json`` follows the schema of the issue (``model``, ``n_prompts``, ``n_pairs``, ``layers`` ->
``min_distance`` / ``closest_pairs`` / ``n_below_threshold`` / ``nn_quantiles``, ``pairs_per_second``,
``matmul_fraction``, ``config``, ``versions``) and adds what a reader needs to reproduce and judge the numbers
(per-layer histograms, the search's own timings and error bounds, machine, seed, memory peak).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .store import write_json
from .ties import same_input


@dataclass(frozen=True)
class CollisionConfig:
    """Everything that determines a collision search's results (and, with the machine, its timings)."""

    model: str
    weights_hash: str
    dtype: str
    corpus: str
    n_prompts: int
    max_tokens: int
    min_tokens: int | None
    layers: tuple[str, ...]
    threshold: float
    k: int
    seed: int
    tile_rows: int
    tile_cols: int
    batch_tokens: int
    chunk_size: int
    executor: str = "inprocess"

    # fields that must match for a run directory to be resumed (the rest only change how fast it goes)
    IDENTITY = ("model", "weights_hash", "dtype", "corpus", "n_prompts", "max_tokens", "min_tokens", "layers",
                "threshold", "k", "seed", "chunk_size")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class ClosePair:
    """One of the k closest pairs at a layer, with both prompts and the exact float64 distance."""

    a_index: int
    b_index: int
    a_ids: tuple[int, ...]
    b_ids: tuple[int, ...]
    a_text: str
    b_text: str
    distance: float
    same_input: bool = False  # the ids differ only in tied tokens (identical embedding rows): identical inputs

    def to_dict(self) -> dict[str, Any]:
        return {
            "a_ids": list(self.a_ids),
            "b_ids": list(self.b_ids),
            "a_text": self.a_text,
            "b_text": self.b_text,
            "distance": self.distance,
            "a_index": self.a_index,
            "b_index": self.b_index,
            "same_input": self.same_input,
        }


@dataclass(frozen=True)
class LayerResult:
    """One layer: exact minimum, closest pairs, collisions under the threshold, NN distribution, search stats."""

    layer: str
    min_distance: float
    closest_pairs: tuple[ClosePair, ...]
    n_below_threshold: int
    nn_quantiles: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)  # histogram, pair sample, error bound, search stats

    @property
    def search(self) -> dict[str, Any]:
        return self.details.get("search", {})

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_distance": self.min_distance,
            "closest_pairs": [p.to_dict() for p in self.closest_pairs],
            "n_below_threshold": self.n_below_threshold,
            "nn_quantiles": self.nn_quantiles,
            **self.details,
        }


def layer_result(
    summary: dict[str, Any],
    ids: list[tuple[int, ...]],
    texts: list[str],
    tied: dict[int, int] | None = None,
    extra: dict[str, Any] | None = None,
) -> LayerResult:
    """A :class:`LayerResult` from a task summary, with each pair's prompts looked up by index.

    ``tied`` maps tokens with identical embedding rows to one representative (see :mod:`.ties`); pairs whose ids
    differ only there are flagged ``same_input``. ``extra`` is merged into the details.
    """
    rep = tied or {}
    pairs = tuple(
        ClosePair(
            int(i),
            int(j),
            ids[int(i)],
            ids[int(j)],
            texts[int(i)],
            texts[int(j)],
            float(dist),
            same_input(ids[int(i)], ids[int(j)], rep),
        )
        for i, j, dist in summary["closest"]
    )
    keep = (
        "n_pairs",
        "threshold",
        "nn_histogram",
        "nn_exact_count",
        "nn_error_bound",
        "nn_spot_check",
        "pair_sample",
        "search",
    )
    return LayerResult(
        layer=str(summary["layer"]),
        min_distance=float(summary["min_distance"]),
        closest_pairs=pairs,
        n_below_threshold=int(summary["n_below_threshold"]),
        nn_quantiles=dict(summary["nn_quantiles"]),
        details={**{key: summary[key] for key in keep if key in summary}, **(extra or {})},
    )


def overall_throughput(layers: list[LayerResult]) -> dict[str, float]:
    """Pairs/s and matmul fraction over all layers: total useful flops / total search time / median matmul rate."""
    seconds = sum(r.search["seconds"] for r in layers)
    pairs = sum(r.details["n_pairs"] for r in layers)
    flops = sum(r.search["pair_flops"] for r in layers)
    reference = statistics.median(s for r in layers for s in r.search["matmul_samples"])
    return {
        "search_seconds": seconds,
        "pairs_per_second": pairs / seconds,
        "achieved_flops_per_second": flops / seconds,
        "matmul_flops_per_second": reference,
        "matmul_fraction": flops / seconds / reference,
    }


@dataclass(frozen=True)
class CollisionResults:
    """A finished collision search; ``to_dict`` is results.json."""

    model: str
    n_prompts: int
    n_pairs: int
    layers: dict[str, LayerResult]
    pairs_per_second: float
    matmul_fraction: float
    config: CollisionConfig
    versions: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)  # machine, timings, memory, corpus, throughput
    paths: dict[str, str] = field(default_factory=dict)  # results.json, results.md, figure

    @property
    def min_distances(self) -> dict[str, float]:
        return {name: r.min_distance for name, r in self.layers.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "n_prompts": self.n_prompts,
            "n_pairs": self.n_pairs,
            "layers": {name: r.to_dict() for name, r in self.layers.items()},
            "pairs_per_second": self.pairs_per_second,
            "matmul_fraction": self.matmul_fraction,
            "config": self.config.to_dict(),
            "versions": self.versions,
            **self.extra,
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        write_json(path, self.to_dict())
        return path


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


def markdown(results: CollisionResults, figure: str | None = None) -> str:
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
