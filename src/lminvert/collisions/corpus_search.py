"""``find_collisions``: corpus -> prompts -> last-token states per layer -> exact search -> results.json.

Run directory (everything needed to resume; nothing finished is recomputed)::

    manifest.json          the run's kind, config and versions (a resumed run must match it)
    prompts.jsonl          the distinct prompts: index, token ids, text, source; corpus.json their summary
    states/layer_LLL.npy   [N, d] float32 last-token states per layer, + states/progress.json
    search/layer_LLL.json  one layer's search summary; search/nn_LLL.npy its nearest-neighbour distances
    search/layer_LLL.blocks/rows_A_B.npz   a layer split into row blocks: each finished block, until merged
    rounding_noise.json    stored states against the same prompts encoded again
    results.json           everything above, summarised (render results.md and the figure with lminvert.report)
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..corpora import Prompt, sample_prompts
from ..errors import LminvertError, check_kind
from ..executors import Executor, get_executor
from ..models import Layer, LayerSpec, LoadedModel
from ..models.loading import require_loaded
from ..models.ties import representatives, same_input, tied_token_groups
from ..paths import atomic_file
from ..runs import RunDirectory, versions
from .fill import fill_with_prompts, prompt_rounding_noise
from .results import CollisionConfig, CollisionResults
from .runner import SearchedStates, SearchSettings, elapsed, layer_results, measure_matmul, run_summary, search_states
from .search import DEFAULT_TILE_COLS, DEFAULT_TILE_ROWS

KIND = "collisions"


def _prompts(model: LoadedModel, config: CollisionConfig, run: RunDirectory) -> tuple[list[Prompt], dict, float]:
    """The run's prompts: read from the directory, or sampled from the corpus and written there."""
    path = run / "prompts.jsonl"
    if path.exists():
        prompts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            prompts.append(Prompt(tuple(record["ids"]), record["text"], record["source"]))
        return prompts, run.step("corpus.json", dict), 0.0
    start = time.perf_counter()
    prompts, summary = sample_prompts(
        model.tokenizer, config.corpus, config.n_prompts, config.max_tokens, config.seed, config.min_tokens
    )
    if len(prompts) < 2:
        raise LminvertError(f"corpus '{config.corpus}' gave only {len(prompts)} distinct prompt: need at least 2")
    run.step("corpus.json", lambda: summary)
    with atomic_file(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for index, p in enumerate(prompts):
            record = {"index": index, "ids": list(p.ids), "text": p.text, "source": p.source}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return prompts, summary, elapsed(start)


def find_collisions(
    model: LoadedModel,
    corpus: str = "mixed",
    n_prompts: int = 1000,
    layers: str | Sequence[LayerSpec] = "all",
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
    block_pairs: int | None = None,
    progress: bool = True,
) -> CollisionResults:
    """Search ``n_prompts`` distinct prompts from ``corpus`` for collisions of their last-token states.

    For each layer: the exact minimum L2 distance over all pairs, the ``k`` closest pairs, the number of pairs
    closer than ``threshold`` and the nearest-neighbour distribution; prompts are sampled with ``seed``. Writes the run
    directory ``out`` (a new temporary directory if None; rerun with the same ``out`` to resume) with its
    results.json; ``lminvert.report.render(results)`` adds results.md and the figure. ``block_pairs``: pairs per
    search task (see :class:`~.runner.SearchSettings`; the result does not depend on it).
    """
    wall = time.perf_counter()
    settings = SearchSettings(threshold, k, seed, tile_rows, tile_cols, block_pairs)
    model = require_loaded(model, "find_collisions")
    _check_sizes(n_prompts, max_tokens, min_tokens, batch_tokens, chunk_size)
    resolved = model.probe.layers(layers)
    runner = get_executor(executor)
    config = _config(
        model, corpus, n_prompts, max_tokens, min_tokens, resolved, settings, batch_tokens, chunk_size, runner
    )
    run = RunDirectory(out, KIND, config.to_dict(), CollisionConfig.IDENTITY)
    prompts, corpus_summary, sample_seconds = _prompts(model, config, run)
    ids = [p.ids for p in prompts]
    before = measure_matmul(len(ids), model.probe.hidden_size, settings)
    searched = search_states(
        run,
        "",
        model,
        resolved,
        len(ids),
        chunk_size,
        fill=lambda store: fill_with_prompts(model, ids, store, resolved, batch_tokens, progress, runner),
        rounding_noise=lambda store: prompt_rounding_noise(model, ids, store, resolved, seed=settings.seed),
        settings=settings,
        executor=runner,
        progress=progress,
    )
    matmul = measure_matmul(len(ids), model.probe.hidden_size, settings, earlier=before)
    results = _results(model, config, run, prompts, corpus_summary, sample_seconds, searched, matmul, wall)
    run.write_results(results.to_dict())
    return results


def _check_sizes(n_prompts: int, max_tokens: int, min_tokens: int | None, batch_tokens: int, chunk_size: int) -> None:
    """One-line errors for :func:`find_collisions`'s sizes, before anything is sampled or computed."""
    sizes = {"n_prompts": n_prompts, "max_tokens": max_tokens, "batch_tokens": batch_tokens, "chunk_size": chunk_size}
    for name, value in {**sizes, **({} if min_tokens is None else {"min_tokens": min_tokens})}.items():
        check_kind(name, value, "int")
    if n_prompts < 2:
        raise LminvertError("--n-prompts must be at least 2 (pairs of prompts are compared)")
    if max_tokens < 1 or (min_tokens is not None and not 1 <= min_tokens <= max_tokens):
        raise LminvertError("--max-tokens must be at least 1 and --min-tokens between 1 and --max-tokens")
    if batch_tokens < 1 or chunk_size < 1:
        raise LminvertError("--batch-tokens and the chunk size must be positive")


def _config(
    model: LoadedModel,
    corpus: str,
    n_prompts: int,
    max_tokens: int,
    min_tokens: int | None,
    resolved: Sequence[Layer],
    settings: SearchSettings,
    batch_tokens: int,
    chunk_size: int,
    runner: Executor,
) -> CollisionConfig:
    """The run's configuration, as its manifest records it."""
    return CollisionConfig(
        model=model.name,
        weights_hash=model.weights_hash,
        dtype=model.dtype,
        corpus=corpus,
        n_prompts=n_prompts,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        layers=tuple(x.name for x in resolved),
        threshold=settings.threshold,
        k=settings.k,
        seed=settings.seed,
        tile_rows=settings.tile_rows,
        tile_cols=settings.tile_cols,
        batch_tokens=batch_tokens,
        chunk_size=chunk_size,
        executor=runner.name,
        block_pairs=settings.block_pairs,
    )


def _results(
    model: LoadedModel,
    config: CollisionConfig,
    run: RunDirectory,
    prompts: list[Prompt],
    corpus_summary: dict,
    sample_seconds: float,
    searched: SearchedStates,
    matmul: dict[str, Any],
    wall: float,
) -> CollisionResults:
    """The search's results per layer (pairs under the threshold that feed identical inputs counted), the run
    summary (timings: sampling, encoding, the total since ``wall``), the corpus summary and the data files."""
    ids = [p.ids for p in prompts]
    rep = representatives(tied_token_groups(model))

    def same_inputs(layer, summary) -> dict:
        listed = summary.get("below_threshold", [])
        return {"n_below_threshold_same_input": sum(same_input(ids[i], ids[j], rep) for i, j, _ in listed)}

    by_layer = layer_results(searched, ids, [p.text for p in prompts], rep, matmul, same_inputs)
    timings = {
        "sampling_seconds": sample_seconds,
        "encoding_seconds": searched.encode_seconds,
        "total_seconds": elapsed(wall),
        "note": "sampling/encoding count only this invocation's work (0 when resumed from disk)",
    }
    extra = run_summary(model, list(by_layer.values()), matmul, timings, config.seed)
    extra["n_pairs_total"] = int(sum(r.details["n_pairs"] for r in by_layer.values()))
    extra["corpus"] = corpus_summary
    return CollisionResults(
        model=model.name,
        n_prompts=len(prompts),
        n_pairs=len(prompts) * (len(prompts) - 1) // 2,
        layers=by_layer,
        pairs_per_second=extra["throughput"]["pairs_per_second"],
        matmul_fraction=extra["throughput"]["matmul_fraction"],
        config=config,
        versions=versions(),
        extra=extra,
        directory=str(run.path),
        files={"nn": {name: [path] for name, path in searched.nn_files.items()}},
    )
