"""Configs and results of the collision search (frozen, JSON-ready); ``CollisionResults.to_dict`` is results.json.

``results.json`` holds ``model``, ``n_prompts``, ``n_pairs``, ``layers`` -> ``min_distance`` / ``closest_pairs`` /
``n_below_threshold`` / ``nn_quantiles``, ``pairs_per_second``, ``matmul_fraction``, ``config``, ``versions``,
and what a reader needs to reproduce and judge the numbers (per-layer histograms, the search's own timings and
error bounds, machine, seed, memory peak). Rendering it (results.md, figures) is :mod:`lminvert.report`'s job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..models.ties import same_input


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
    block_pairs: int | None = None  # pairs per search task (None: automatic)

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
    name: str,
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
        layer=name,
        min_distance=float(summary["min_distance"]),
        closest_pairs=pairs,
        n_below_threshold=int(summary["n_below_threshold"]),
        nn_quantiles=dict(summary["nn_quantiles"]),
        details={**{key: summary[key] for key in keep if key in summary}, **(extra or {})},
    )


def overall_throughput(layers: list[LayerResult], matmul: dict[str, Any]) -> dict[str, Any]:
    """Pairs/s and matmul fraction over all layers: total useful flops / total search time / the run's matmul
    reference (:func:`.throughput.matmul_reference`)."""
    seconds = sum(r.search["seconds"] for r in layers)
    pairs = sum(r.details["n_pairs"] for r in layers)
    flops = sum(r.search["pair_flops"] for r in layers)
    reference = matmul["flops_per_second"]
    return {
        "search_seconds": seconds,
        "pairs_per_second": pairs / seconds,
        "achieved_flops_per_second": flops / seconds,
        "matmul_flops_per_second": reference,
        "matmul_samples": matmul["samples"],
        "matmul_shape": matmul["shape"],
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
    directory: str = ""  # the run directory (results.json is there; lminvert.report renders the rest)
    files: dict[str, Any] = field(default_factory=dict)  # data files in it, e.g. {"nn": {layer: [paths]}}

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
            "files": self.files,
        }

    def layer_minima(self) -> dict[str, tuple[float, int]]:
        """Per layer: the minimum distance and the number of pairs under the threshold."""
        return {name: (r.min_distance, r.n_below_threshold) for name, r in self.layers.items()}
