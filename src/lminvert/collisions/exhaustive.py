"""The exhaustive next-token test: for a prefix, append every vocabulary token and compare all continuations.

For each prefix the KV cache of blocks 1..top is built once; the |V| one-token continuations run in batches over
it (:func:`.encoding.encode_continuations`) and their last-position states are stored per layer. Each layer's
|V| states then go through the same exact blocked search as the collision run: |V|(|V|-1)/2 pairs
(1.2×10⁹ for a 49,152-token vocabulary) per prefix and layer, minimum exact in float64.

Run directory: ``manifest.json``, ``prefix_MMM/{states,search}/`` and ``prefix_MMM/rounding_noise.json``
(resumable like a collision run), ``results.json``; ``lminvert.report.render`` adds results.md and the figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import LminvertError
from ..executors import Executor, get_executor
from ..forward import token_ids_of
from ..models import DEFAULT_LAYERS, Layer, LayerSpec, LoadedModel
from ..models.loading import require_loaded
from ..models.ties import representatives, tied_pairs, tied_token_groups
from ..paths import read_json
from ..runs import RunDirectory, versions
from .fill import continuation_rounding_noise, fill_with_continuations
from .identical_inputs import differing_summary, search_depth, tied_distances, tied_summary
from .results import LayerResult
from .runner import SearchedStates, SearchSettings, elapsed, layer_results, measure_matmul, run_summary, search_states
from .search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS

KIND = "exhaustive"


@dataclass(frozen=True)
class ExhaustiveConfig:
    model: str
    weights_hash: str
    dtype: str
    prefixes: tuple[tuple[int, ...], ...]
    layers: tuple[str, ...]
    threshold: float
    k: int
    seed: int
    batch_size: int
    tile_rows: int
    tile_cols: int
    executor: str = "inprocess"
    block_pairs: int | None = None  # pairs per search task (None: automatic)

    IDENTITY = ("model", "weights_hash", "dtype", "prefixes", "layers", "threshold", "k", "batch_size")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prefixes"] = [list(p) for p in self.prefixes]
        out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class PrefixResult:
    """One prefix: per layer, the exact minimum over all pairs of its |V| continuations."""

    index: int
    ids: tuple[int, ...]
    text: str
    layers: dict[str, LayerResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "text": self.text,
            "layers": {name: r.to_dict() for name, r in self.layers.items()},
        }


@dataclass(frozen=True)
class ExhaustiveResults:
    model: str
    vocab_size: int
    n_pairs: int  # per prefix and layer
    prefixes: tuple[PrefixResult, ...]
    pairs_per_second: float
    matmul_fraction: float
    config: ExhaustiveConfig
    versions: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)
    directory: str = ""  # the run directory (results.json is there; lminvert.report renders the rest)
    files: dict[str, Any] = field(default_factory=dict)  # data files in it: {"nn": {layer: [path per prefix]}}

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        """Per layer over all prefixes: the smallest minimum, the total count under the threshold."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.prefixes:
            for name, r in p.layers.items():
                row = out.setdefault(
                    name,
                    {"min_distance": float("inf"), "n_below_threshold": 0, "prefix": -1,
                     "min_distance_inputs_differ": None, "n_below_threshold_inputs_differ": 0},
                )  # fmt: skip
                if r.min_distance < row["min_distance"]:
                    row.update(min_distance=r.min_distance, prefix=p.index)
                row["n_below_threshold"] += r.n_below_threshold
                differ = r.details.get("inputs_differ", {})
                row["n_below_threshold_inputs_differ"] += differ.get("n_below_threshold", r.n_below_threshold)
                best = differ.get("min_distance")
                if best is not None and (
                    row["min_distance_inputs_differ"] is None or best < row["min_distance_inputs_differ"]
                ):
                    row["min_distance_inputs_differ"] = best
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "n_prefixes": len(self.prefixes),
            "vocab_size": self.vocab_size,
            "n_pairs": self.n_pairs,
            "n_pairs_total": self.n_pairs * len(self.prefixes) * len(self.config.layers),
            "layers": self.layers,
            "prefixes": [p.to_dict() for p in self.prefixes],
            "pairs_per_second": self.pairs_per_second,
            "matmul_fraction": self.matmul_fraction,
            "config": self.config.to_dict(),
            "versions": self.versions,
            **self.extra,
            "files": self.files,
        }

    def layer_minima(self) -> dict[str, tuple[float, int]]:
        """Per layer over all prefixes: the minimum distance and the number of pairs under the threshold."""
        return {name: (row["min_distance"], row["n_below_threshold"]) for name, row in self.layers.items()}


def prefixes_from_collisions(directory: str | Path, count: int) -> list[tuple[int, ...]]:
    """The prompts of the closest pairs of a collision run (layer by layer, closest first), ``count`` distinct."""
    path = Path(directory) / "results.json"
    if not path.is_file():
        raise LminvertError(f"no results.json in {directory}: run `lminvert collisions --out {directory}` first")
    doc = read_json(path)
    ranked = sorted(
        ((rank, pair) for r in doc.get("layers", {}).values() for rank, pair in enumerate(r.get("closest_pairs", []))),
        key=lambda item: (item[0], item[1]["distance"]),
    )
    chosen: list[tuple[int, ...]] = []
    for _, pair in ranked:
        for ids in (tuple(pair["a_ids"]), tuple(pair["b_ids"])):
            if ids not in chosen and len(chosen) < count:
                chosen.append(ids)
    if not chosen:
        raise LminvertError(f"{path} lists no closest pairs to take prefixes from")
    return chosen


def exhaustive_test(
    model: LoadedModel,
    prefixes: Sequence[str | Sequence[int]],
    layers: str | Sequence[LayerSpec] = DEFAULT_LAYERS,
    out: str | Path | None = None,
    threshold: float = 1e-6,
    k: int = 10,
    seed: int = 0,
    batch_size: int = 1024,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_cols: int = DEFAULT_TILE_COLS,
    executor: str | Executor | None = None,
    block_pairs: int | None = None,
    progress: bool = True,
) -> ExhaustiveResults:
    """For each prefix, the exact minimum distance among all |V| one-token continuations, per layer.

    ``layers`` defaults to the first, middle and last block of the model. Writes the run directory ``out`` (a new
    temporary directory if None; rerun with the same ``out`` to resume) with its results.json. ``block_pairs``:
    pairs per search task (see :class:`~.runner.SearchSettings`; the result does not depend on it).
    """
    wall = time.perf_counter()
    settings = SearchSettings(threshold, k, seed, tile_rows, tile_cols, block_pairs)
    model = require_loaded(model, "exhaustive_test")
    if batch_size < 1:
        raise LminvertError("--batch-size must be positive")
    ids = _prefix_ids(model, prefixes)
    resolved = model.probe.layers(layers)
    runner = get_executor(executor)
    config = _config(model, ids, resolved, settings, batch_size, runner)
    run = RunDirectory(out, KIND, config.to_dict(), ExhaustiveConfig.IDENTITY)
    vocab = model.probe.vocab_size
    groups = tied_token_groups(model)
    tied = tied_pairs(groups)
    rep = representatives(groups)
    token_texts = [model.decode([t]) for t in range(vocab)]
    before = measure_matmul(vocab, model.probe.hidden_size, settings)
    searched_all = [
        _search_prefix(run, model, index, ids, resolved, batch_size, settings, runner, tied, progress)
        for index in range(len(ids))
    ]
    matmul = measure_matmul(vocab, model.probe.hidden_size, settings, earlier=before)
    results = [
        _prefix_result(model, index, prefix, searched, token_texts, groups, tied, rep, matmul, settings)
        for index, (prefix, searched) in enumerate(zip(ids, searched_all, strict=True))
    ]
    done = _results(model, config, run, results, searched_all, resolved, matmul, wall)
    run.write_results(done.to_dict())
    return done


def _prefix_ids(model: LoadedModel, prefixes: Sequence[str | Sequence[int]]) -> list[tuple[int, ...]]:
    """The prefixes as token ids (text tokenized), each checked against the vocabulary; none is an error."""
    if prefixes is None or (isinstance(prefixes, Sequence) and not len(prefixes)):
        raise LminvertError("no prefixes given: pass --prefix TEXT or --from-collisions DIR")
    ids = [tuple(p) for p in token_ids_of(model, prefixes)]  # one text, or one prefix's ids, is one prefix
    for prefix in ids:
        model.probe.check_ids(torch.tensor(prefix, dtype=torch.long))
    return ids


def _config(
    model: LoadedModel,
    ids: list[tuple[int, ...]],
    resolved: Sequence[Layer],
    settings: SearchSettings,
    batch_size: int,
    runner: Executor,
) -> ExhaustiveConfig:
    """The run's configuration, as its manifest records it."""
    return ExhaustiveConfig(
        model=model.name,
        weights_hash=model.weights_hash,
        dtype=model.dtype,
        prefixes=tuple(ids),
        layers=tuple(x.name for x in resolved),
        threshold=settings.threshold,
        k=settings.k,
        seed=settings.seed,
        batch_size=batch_size,
        tile_rows=settings.tile_rows,
        tile_cols=settings.tile_cols,
        executor=runner.name,
        block_pairs=settings.block_pairs,
    )


def _search_prefix(
    run: RunDirectory,
    model: LoadedModel,
    index: int,
    ids: list[tuple[int, ...]],
    resolved: Sequence[Layer],
    batch_size: int,
    settings: SearchSettings,
    runner: Executor,
    tied: list[tuple[int, int]],
    progress: bool,
) -> SearchedStates:
    """Prefix ``index``'s |V| continuations: their states per layer, searched (resumed from ``prefix_III/``)."""
    prefix = ids[index]
    return search_states(
        run,
        f"prefix_{index:03d}",
        model,
        resolved,
        model.probe.vocab_size,
        batch_size,
        fill=lambda store: fill_with_continuations(
            model, prefix, store, resolved, progress, f"prefix {index + 1}/{len(ids)}", runner
        ),
        rounding_noise=lambda store: continuation_rounding_noise(model, prefix, store, resolved, seed=settings.seed),
        settings=settings,
        executor=runner,
        k=search_depth(settings.k, tied),
        label=f"prefix {index + 1} ",
        progress=progress,
    )


def _prefix_result(
    model: LoadedModel,
    index: int,
    prefix: tuple[int, ...],
    searched: SearchedStates,
    token_texts: list[str],
    groups: list[list[int]],
    tied: list[tuple[int, int]],
    rep: dict[int, int],
    matmul: dict[str, Any],
    settings: SearchSettings,
) -> PrefixResult:
    """One prefix's per-layer results, with the tied-token and differing-input summaries, ``k`` closest pairs."""
    threshold, k = settings.threshold, settings.k
    shown = model.decode(list(prefix)) if prefix else ""
    full_ids = [(*prefix, t) for t in range(model.probe.vocab_size)]
    texts = [f"{shown}⟨{tok}⟩" for tok in token_texts]

    def ties_of(layer, summary) -> dict:
        distance = tied_distances(searched.states(layer), tied)  # measured once, used by both summaries
        return {
            "tied_tokens": tied_summary(distance, groups, threshold),
            "inputs_differ": differing_summary(summary, tied, distance, k, threshold),
        }

    by_layer = layer_results(searched, full_ids, texts, rep, matmul, ties_of)
    by_layer = {name: replace(r, closest_pairs=r.closest_pairs[:k]) for name, r in by_layer.items()}
    return PrefixResult(index, prefix, shown, by_layer)


def _results(
    model: LoadedModel,
    config: ExhaustiveConfig,
    run: RunDirectory,
    results: list[PrefixResult],
    searched_all: list[SearchedStates],
    resolved: Sequence[Layer],
    matmul: dict[str, Any],
    wall: float,
) -> ExhaustiveResults:
    """The run's results: every prefix's, the run summary (throughput, timings since ``wall``), the data files."""
    vocab = model.probe.vocab_size
    all_layers = [r for p in results for r in p.layers.values()]
    timings = {"encoding_seconds": sum(s.encode_seconds for s in searched_all), "total_seconds": elapsed(wall)}
    extra = run_summary(model, all_layers, matmul, timings, config.seed)
    nn = {layer.name: [s.nn_files[layer.name] for s in searched_all] for layer in resolved}
    return ExhaustiveResults(
        model=model.name,
        vocab_size=vocab,
        n_pairs=vocab * (vocab - 1) // 2,
        prefixes=tuple(results),
        pairs_per_second=extra["throughput"]["pairs_per_second"],
        matmul_fraction=extra["throughput"]["matmul_fraction"],
        config=config,
        versions=versions(),
        extra=extra,
        directory=str(run.path),
        files={"nn": nn},
    )
