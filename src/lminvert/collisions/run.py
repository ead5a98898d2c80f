"""``find_collisions``: corpus -> prompts -> last-token states per layer -> exact search -> results files.

Output directory layout (everything needed to resume, nothing recomputed that is finished)::

    manifest.json          the run's config and versions (a resumed run must match it)
    prompts.jsonl          the distinct prompts: index, token ids, text, source
    states/layer_LLL.npy   [N, d] float32 last-token states per layer, + states/progress.json
    search/layer_LLL.json  one layer's search summary; search/nn_LLL.npy its nearest-neighbour distances
    results.json, results.md, nn_distances.png
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..corpora import Prompt, sample_prompts
from ..errors import LminvertError
from ..executors import Executor, get_executor
from ..models import DEFAULT_MODEL, LoadedModel, load_model
from ..report.collisions import plot_nn_distances
from .encoding import encode_prompts, prompt_rounding_noise
from .results import CollisionConfig, CollisionResults, layer_result, markdown, overall_throughput
from .search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS
from .store import StateStore, read_json, write_json
from .tasks import LayerTask, layer_tasks, run_layer_task
from .throughput import machine, peak_rss_mb, versions
from .ties import representatives, same_input, tied_token_groups

log = logging.getLogger(__name__)

FIGURE = "nn_distances.png"


def resolve_layers(model: LoadedModel, layers: str | Sequence[int | str]) -> list[int]:
    """``"all"`` -> 1..L; else each spec resolved by the probe (one-line error if out of range), deduplicated."""
    probe = model.probe
    if isinstance(layers, str):
        text = layers.strip().lower()
        specs: list[int | str] = (
            list(range(1, probe.n_layers + 1)) if text == "all" else [p for p in text.split(",") if p.strip()]
        )
    else:
        specs = list(layers)
    if not specs:
        raise LminvertError("no layers given: use --layers all or a list like 1,15,30")
    return sorted({probe.resolve_layer(spec) for spec in specs})


def _model(model: LoadedModel | str) -> LoadedModel:
    return model if isinstance(model, LoadedModel) else load_model(model)


def _check_manifest(out: Path, config: CollisionConfig) -> None:
    path = out / "manifest.json"
    if not path.exists():
        write_json(path, {"config": config.to_dict(), "versions": versions()})
        return
    old = read_json(path).get("config", {})
    new = config.to_dict()
    for key in CollisionConfig.IDENTITY:
        if old.get(key) != new.get(key):
            raise LminvertError(
                f"{out} holds a different collision run ({key}: {old.get(key)!r} there, {new.get(key)!r} now); "
                "use a new --out directory or delete that one"
            )
    log.info("resuming the run in %s", out)


def _prompts(model: LoadedModel, config: CollisionConfig, out: Path) -> tuple[list[Prompt], dict, float]:
    path = out / "prompts.jsonl"
    if path.exists():
        prompts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            prompts.append(Prompt(tuple(record["ids"]), record["text"], record["source"]))
        return prompts, read_json(out / "corpus.json"), 0.0
    start = time.perf_counter()
    prompts, summary = sample_prompts(
        model.tokenizer, config.corpus, config.n_prompts, config.max_tokens, config.seed, config.min_tokens
    )
    if len(prompts) < 2:
        raise LminvertError(f"corpus '{config.corpus}' gave only {len(prompts)} distinct prompt: need at least 2")
    write_json(out / "corpus.json", summary)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for index, p in enumerate(prompts):
            record = {"index": index, "ids": list(p.ids), "text": p.text, "source": p.source}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return prompts, summary, time.perf_counter() - start


def _noise(loaded: LoadedModel, ids: list[tuple[int, ...]], store: StateStore, out: Path, seed: int) -> dict:
    path = out / "noise.json"
    if path.exists():
        return read_json(path)
    noise = {str(layer): value for layer, value in prompt_rounding_noise(loaded, ids, store, seed=seed).items()}
    write_json(path, noise)
    return noise


def find_collisions(
    model: LoadedModel | str = DEFAULT_MODEL,
    corpus: str = "mixed",
    n_prompts: int = 1000,
    layers: str | Sequence[int | str] = "all",
    max_tokens: int = 32,
    out: str | Path | None = None,
    threshold: float = 1e-6,
    k: int = 10,
    seed: int = 0,
    min_tokens: int | None = None,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_cols: int = DEFAULT_TILE_COLS,
    batch_tokens: int = 4096,
    chunk_size: int = 512,
    executor: str | Executor | None = None,
    progress: bool = True,
    figure: bool = True,
) -> CollisionResults:
    """Search ``n_prompts`` distinct prompts from ``corpus`` for collisions of their last-token states.

    For each layer: the exact minimum L2 distance over all pairs, the ``k`` closest pairs, the number of pairs
    closer than ``threshold`` and the nearest-neighbour distribution. Writes results.json, results.md and the
    figure to ``out`` (a new temporary directory if None); rerun with the same ``out`` to resume.
    """
    wall = time.perf_counter()
    loaded = _model(model)
    if n_prompts < 2:
        raise LminvertError("--n-prompts must be at least 2 (pairs of prompts are compared)")
    if k < 1:
        raise LminvertError("--k must be at least 1")
    if not threshold >= 0:
        raise LminvertError("--threshold must be a non-negative number")
    resolved = resolve_layers(loaded, layers)
    runner = get_executor(executor)
    config = CollisionConfig(
        model=loaded.name,
        weights_hash=loaded.weights_hash,
        dtype=loaded.dtype,
        corpus=corpus,
        n_prompts=n_prompts,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        layers=tuple(loaded.probe.layer_name(x) for x in resolved),
        threshold=threshold,
        k=k,
        seed=seed,
        tile_rows=tile_rows,
        tile_cols=tile_cols,
        batch_tokens=batch_tokens,
        chunk_size=chunk_size,
        executor=runner.name,
    )
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="lminvert-collisions-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(out_dir, config)
    prompts, corpus_summary, sample_seconds = _prompts(loaded, config, out_dir)
    ids = [p.ids for p in prompts]
    store = StateStore(out_dir / "states", len(ids), loaded.probe.hidden_size, resolved, chunk_size)
    encode_seconds = encode_prompts(loaded, ids, store, batch_tokens=batch_tokens, progress=progress)
    settings = dict(k=k, threshold=threshold, tile_rows=tile_rows, tile_cols=tile_cols, seed=seed, progress=progress)
    tasks = layer_tasks(store, out_dir, loaded.probe.layer_name, **settings)
    if not store.complete:
        raise LminvertError(f"{out_dir}: encoding did not finish; rerun the same command to resume")
    summaries = runner.map(run_layer_task, tasks)
    noise = _noise(loaded, ids, store, out_dir, seed)
    rep = representatives(tied_token_groups(loaded))
    texts = [p.text for p in prompts]
    by_layer = {}
    for s in summaries:
        listed = s.get("below_threshold", [])
        extra = {
            "rounding_noise": noise[str(s["layer"])],
            "n_below_threshold_same_input": sum(same_input(ids[i], ids[j], rep) for i, j, _ in listed),
        }
        by_layer[loaded.probe.layer_name(s["layer"])] = layer_result(s, ids, texts, rep, extra)
    throughput = overall_throughput(list(by_layer.values()))
    extra = {
        "n_pairs_total": int(sum(r.details["n_pairs"] for r in by_layer.values())),
        "throughput": throughput,
        "timings": {
            "sampling_seconds": sample_seconds,
            "encoding_seconds": encode_seconds,
            "search_seconds": throughput["search_seconds"],
            "total_seconds": time.perf_counter() - wall,
            "note": "sampling/encoding count only this invocation's work (0 when resumed from disk)",
        },
        "memory_peak_mb": peak_rss_mb(),
        "seed": seed,
        "dtype": loaded.dtype,
        "threads": machine()["torch_threads"],
        "machine": machine(),
        "corpus": corpus_summary,
        "model_info": loaded.describe(),
    }
    results = CollisionResults(
        model=loaded.name,
        n_prompts=len(prompts),
        n_pairs=len(prompts) * (len(prompts) - 1) // 2,
        layers=by_layer,
        pairs_per_second=throughput["pairs_per_second"],
        matmul_fraction=throughput["matmul_fraction"],
        config=config,
        versions=versions(),
        extra=extra,
        paths={},
    )
    return write_outputs(results, out_dir, tasks, figure)


def write_outputs(
    results: CollisionResults, out_dir: Path, tasks: Sequence[LayerTask], figure: bool = True
) -> CollisionResults:
    """results.json, results.md and the figure; returns the results with their paths filled in."""
    paths = {"json": str(out_dir / "results.json"), "markdown": str(out_dir / "results.md")}
    if figure:
        names = list(results.layers)
        nn = [np.load(t.out_nn) for t in tasks]
        title = (
            f"{results.model}: nearest-neighbour distance of {results.n_prompts} prompts' last-token states "
            f"({results.config.corpus})"
        )
        paths["figure"] = str(
            plot_nn_distances(
                names,
                nn,
                [results.layers[n].min_distance for n in names],
                out_dir / FIGURE,
                results.config.threshold,
                title,
            )
        )
    done = CollisionResults(**{**results.__dict__, "paths": paths})
    done.write_json(paths["json"])
    Path(paths["markdown"]).write_text(markdown(done, FIGURE if figure else None), encoding="utf-8")
    log.info("wrote %s", ", ".join(paths.values()))
    return done


@dataclass(frozen=True)
class CollisionDemo:
    """What the demo shows: the results and the paths of its table and figure."""

    results: CollisionResults
    table: Path
    figure: Path


def demo_run(
    model: LoadedModel | str,
    out_dir: str | Path,
    n_prompts: int = 300,
    layers: Sequence[int | str] | None = (1, 15, 30),
    corpus: str = "mixed",
    max_tokens: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> CollisionDemo:
    """A small collision search for ``lminvert demo`` (prints nothing; logs).

    If the model lacks some of ``layers``, layers 1, L/2 and L are searched instead. A rerun with the same settings
    reuses ``out_dir``; one with other settings replaces the demo run found there.
    """
    loaded = _model(model)
    top = loaded.probe.n_layers
    wanted: list[int | str] = [x for x in (layers or ()) if isinstance(x, str) or -top <= int(x) <= top]
    if not layers or len(wanted) < len(layers):
        wanted = sorted({1, max(1, top // 2), top})
        log.info("%s has %d layers: the demo searches layers %s", loaded.name, top, wanted)
    settings = dict(corpus=corpus, n_prompts=n_prompts, layers=wanted, max_tokens=max_tokens, seed=seed)
    try:
        results = find_collisions(loaded, out=out_dir, progress=progress, **settings)
    except LminvertError as exc:
        if "different collision run" not in str(exc):
            raise
        # the demo's own directory, left by a demo with other settings: start it afresh
        log.info("%s held a demo run with other settings; replacing it", out_dir)
        shutil.rmtree(out_dir)
        results = find_collisions(loaded, out=out_dir, progress=progress, **settings)
    return CollisionDemo(results, Path(results.paths["markdown"]), Path(results.paths["figure"]))
