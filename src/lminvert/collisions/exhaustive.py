"""The exhaustive next-token test: for a prefix, append every vocabulary token and compare all continuations.

For each prefix the KV cache of blocks 1..top is built once; the |V| one-token continuations run in batches over
it (:func:`.encoding.encode_continuations`) and their last-position states are stored per layer. Each layer's
|V| states then go through the same exact blocked search as the collision run: |V|(|V|-1)/2 pairs
(1.2×10⁹ for a 49,152-token vocabulary) per prefix and layer, minimum exact in float64.

Output directory: ``manifest.json``, ``prefix_MMM/{states,search}/`` (resumable like a collision run),
``results.json``, ``results.md`` and ``nn_distances.png``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import LminvertError
from ..executors import Executor, get_executor
from ..models import LoadedModel, load_model
from ..report.collisions import plot_nn_distances
from .encoding import continuation_rounding_noise, encode_continuations
from .results import LayerResult, layer_result, layer_table, overall_throughput
from .search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS, exact_sq_distances
from .store import StateStore, read_json, write_json
from .tasks import layer_tasks, run_layer_task
from .throughput import machine, peak_rss_mb, versions
from .ties import representatives, tied_pairs, tied_token_groups

log = logging.getLogger(__name__)

MAX_TIED = 5000  # beyond this many tied pairs, the closest pairs with differing inputs are not tracked


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
    paths: dict[str, str] = field(default_factory=dict)

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
        }


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
    model: LoadedModel | str,
    prefixes: Sequence[str | Sequence[int]],
    layers: str | Sequence[int | str] = (1, 15, 30),
    out: str | Path | None = None,
    threshold: float = 1e-6,
    k: int = 10,
    seed: int = 0,
    batch_size: int = 1024,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_cols: int = DEFAULT_TILE_COLS,
    executor: str | Executor | None = None,
    progress: bool = True,
    figure: bool = True,
) -> ExhaustiveResults:
    """For each prefix, the exact minimum distance among all |V| one-token continuations, per layer."""
    from .run import resolve_layers  # avoid a cycle at import time

    wall = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    probe = loaded.probe
    if not prefixes:
        raise LminvertError("no prefixes given: pass --prefix TEXT or --from-collisions DIR")
    ids = [tuple(loaded.tokenize(p)) if isinstance(p, str) else tuple(int(t) for t in p) for p in prefixes]
    for prefix in ids:
        probe.check_ids(torch.tensor(prefix, dtype=torch.long))
    resolved = resolve_layers(loaded, layers)
    runner = get_executor(executor)
    config = ExhaustiveConfig(
        model=loaded.name,
        weights_hash=loaded.weights_hash,
        dtype=loaded.dtype,
        prefixes=tuple(ids),
        layers=tuple(probe.layer_name(x) for x in resolved),
        threshold=threshold,
        k=k,
        seed=seed,
        batch_size=batch_size,
        tile_rows=tile_rows,
        tile_cols=tile_cols,
        executor=runner.name,
    )
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="lminvert-exhaustive-"))
    _check_manifest(out_dir, config)
    vocab = probe.vocab_size
    groups = tied_token_groups(loaded)
    tied = tied_pairs(groups)
    rep = representatives(groups)
    # search deep enough that the k closest pairs whose inputs differ are known exactly, past every tied pair
    k_search = k + len(tied) if len(tied) <= MAX_TIED else k
    if tied:
        log.info("%d tokens share an embedding row with another (%d tied pairs)", len({t for g in groups for t in g}),
                 len(tied))  # fmt: skip
    token_texts = [loaded.decode([t]) for t in range(vocab)]
    results, encode_seconds, nn_paths = [], 0.0, []
    for index, prefix in enumerate(ids):
        base = out_dir / f"prefix_{index:03d}"
        store = StateStore(base / "states", vocab, probe.hidden_size, resolved, batch_size)
        encode_seconds += encode_continuations(
            loaded, prefix, store, progress=progress, desc=f"prefix {index + 1}/{len(ids)}"
        )
        settings = dict(k=k_search, threshold=threshold, tile_rows=tile_rows, tile_cols=tile_cols, seed=seed)
        tasks = layer_tasks(store, base, probe.layer_name, f"prefix {index + 1} ", progress=progress, **settings)
        summaries = runner.map(run_layer_task, tasks)
        noise = _noise(loaded, prefix, store, base, seed)
        full_ids = [(*prefix, t) for t in range(vocab)]
        texts = [f"{loaded.decode(list(prefix)) if prefix else ''}⟨{tok}⟩" for tok in token_texts]
        by_layer = {}
        for s in summaries:
            x = store.layer(s["layer"])
            extra = {
                "rounding_noise": noise[str(s["layer"])],
                "tied_tokens": _tied_summary(x, groups, tied, threshold),
                "inputs_differ": _untied_summary(s, tied, k, threshold, x, complete=k_search > k or not tied),
            }
            full = layer_result(s, full_ids, texts, rep, extra)
            by_layer[probe.layer_name(s["layer"])] = replace(full, closest_pairs=full.closest_pairs[:k])
        results.append(PrefixResult(index, prefix, loaded.decode(list(prefix)) if prefix else "", by_layer))
        nn_paths.append([t.out_nn for t in tasks])
    all_layers = [r for p in results for r in p.layers.values()]
    throughput = overall_throughput(all_layers)
    extra = {
        "throughput": throughput,
        "timings": {
            "encoding_seconds": encode_seconds,
            "search_seconds": throughput["search_seconds"],
            "total_seconds": time.perf_counter() - wall,
        },
        "memory_peak_mb": peak_rss_mb(),
        "seed": seed,
        "dtype": loaded.dtype,
        "threads": machine()["torch_threads"],
        "machine": machine(),
        "model_info": loaded.describe(),
    }
    done = ExhaustiveResults(
        model=loaded.name,
        vocab_size=vocab,
        n_pairs=vocab * (vocab - 1) // 2,
        prefixes=tuple(results),
        pairs_per_second=throughput["pairs_per_second"],
        matmul_fraction=throughput["matmul_fraction"],
        config=config,
        versions=versions(),
        extra=extra,
    )
    return _write(done, out_dir, nn_paths, figure)


def _noise(loaded: LoadedModel, prefix: tuple[int, ...], store: StateStore, base: Path, seed: int) -> dict:
    path = base / "noise.json"
    if path.exists():
        return read_json(path)
    noise = {str(k): v for k, v in continuation_rounding_noise(loaded, prefix, store, seed=seed).items()}
    write_json(path, noise)
    return noise


def _tied_summary(x: np.ndarray, groups: list[list[int]], tied: list[tuple[int, int]], threshold: float) -> dict:
    """Exact distances between continuations by tokens with identical embedding rows (identical inputs)."""
    if not tied:
        return {"groups": [], "n_pairs": 0}
    i, j = np.array(tied).T
    distance = np.sqrt(exact_sq_distances(x, i, j))
    return {
        "groups": groups,
        "n_pairs": len(tied),
        "n_below_threshold": int(np.count_nonzero(distance < threshold)),
        "max_distance": float(distance.max()),
    }


def _untied_summary(
    summary: dict, tied: list[tuple[int, int]], k: int, threshold: float, x: np.ndarray, complete: bool
) -> dict:
    """The k closest pairs whose inputs differ, and the count of such pairs under the threshold."""
    tied_set = set(tied)
    rows = [(int(i), int(j), float(d)) for i, j, d in summary["closest"] if (int(i), int(j)) not in tied_set]
    tied_below = 0
    if tied:
        i, j = np.array(tied).T
        tied_below = int(np.count_nonzero(np.sqrt(exact_sq_distances(x, i, j)) < threshold))
    return {
        "min_distance": rows[0][2] if rows and complete else None,
        "closest_pairs": [{"a_token": i, "b_token": j, "distance": d} for i, j, d in rows[:k]] if complete else [],
        "n_below_threshold": int(summary["n_below_threshold"]) - tied_below,
    }


def _check_manifest(out_dir: Path, config: ExhaustiveConfig) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "manifest.json"
    new = config.to_dict()
    if path.exists():
        old = read_json(path).get("config", {})
        for key in ExhaustiveConfig.IDENTITY:
            if old.get(key) != new.get(key):
                raise LminvertError(
                    f"{out_dir} holds a different exhaustive run ({key} differs); use a new --out or delete it"
                )
    else:
        write_json(path, {"config": new, "versions": versions()})


def _write(results: ExhaustiveResults, out_dir: Path, nn_paths: list[list[str]], figure: bool) -> ExhaustiveResults:
    paths = {"json": str(out_dir / "results.json"), "markdown": str(out_dir / "results.md")}
    names = list(results.config.layers)
    if figure:
        pooled = [np.concatenate([np.load(p[i]) for p in nn_paths]) for i in range(len(names))]
        minima = [results.layers[n]["min_distance"] for n in names]
        title = (
            f"{results.model}: nearest-neighbour distance among all {results.vocab_size} one-token continuations "
            f"({len(results.prefixes)} prefix(es))"
        )
        paths["figure"] = str(
            plot_nn_distances(
                names,
                pooled,
                minima,
                out_dir / "nn_distances.png",
                results.config.threshold,
                title,
                unit="continuations",
                second_minima=[results.layers[n]["min_distance_inputs_differ"] for n in names],
                second_label="minimum over pairs whose inputs differ (tied tokens aside)",
            )
        )
    done = ExhaustiveResults(**{**results.__dict__, "paths": paths})
    write_json(Path(paths["json"]), done.to_dict())
    Path(paths["markdown"]).write_text(_markdown(done, "nn_distances.png" if figure else None), encoding="utf-8")
    return done


def _markdown(results: ExhaustiveResults, figure: str | None) -> str:
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
