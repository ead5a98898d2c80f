"""End to end on tiny random models: planted collisions, resume after an interruption, outputs, the exhaustive test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import lminvert
from lminvert.cli.demo import demo_collisions
from lminvert.collisions import exhaustive_test, find_collisions
from lminvert.collisions import runner as run_module
from lminvert.collisions import tasks as tasks_module
from lminvert.collisions.runner import DEFAULT_BLOCK_PAIRS, MIN_BLOCK_PAIRS, SearchSettings
from lminvert.collisions.search import DEFAULT_TILE_COLS, row_blocks
from lminvert.collisions.store import StateStore
from lminvert.errors import LminvertError
from lminvert.executors import get_executor
from lminvert.models import LoadedModel
from lminvert.states import HiddenStates

from ..conftest import small_vocab_llama

WORDS = [" cat", " dog", " cow", " pig", " hen", " fox", " owl", " bee"]


@pytest.fixture(scope="module")
def planted():
    """tiny-llama (its own seed) where the tokens ' cat' and ' dog' share one embedding row."""
    base = lminvert.load_model("tiny-llama", seed=7)
    tok = base.tokenizer
    cat, dog = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" cat", " dog"))
    with torch.no_grad():
        base.probe.embedding.weight[dog] = base.probe.embedding.weight[cat]
    model = LoadedModel.wrap("tiny-llama-planted", base.model, tok)  # edited weights: a new identity
    assert model.weights_hash != base.weights_hash
    return model


def _animal_corpus(path):
    lines = [f'{{"text": "the quick{w}"}}' for w in WORDS] + [f'{{"text": "a lazy{w} sat"}}' for w in WORDS]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_planted_collision_is_found_at_distance_zero(planted, tmp_path):
    corpus = _animal_corpus(tmp_path / "animals.jsonl")
    results = find_collisions(planted, corpus=corpus, n_prompts=16, layers="all", max_tokens=16, out=tmp_path / "run")
    assert results.n_prompts == 16  # all distinct windows (the whole short documents)
    for name, layer in results.layers.items():
        assert layer.min_distance == 0.0, name
        # "the quick cat"/"the quick dog" and "a lazy cat sat"/"a lazy dog sat": identical states, distinct ids
        assert layer.n_below_threshold == 2
        pairs = {frozenset((p.a_text, p.b_text)) for p in layer.closest_pairs[:2]}
        assert pairs == {frozenset(("the quick cat", "the quick dog")), frozenset(("a lazy cat sat", "a lazy dog sat"))}
        assert all(p.a_ids != p.b_ids and p.distance == 0.0 and p.same_input for p in layer.closest_pairs[:2])
        assert layer.details["n_below_threshold_same_input"] == 2  # flagged: the ids differ, the inputs do not
        assert layer.closest_pairs[2].distance > 1e-3  # every other pair is far from a collision
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["layers"]["1"]["n_below_threshold"] == 2


def test_results_files_and_schema(tmp_path):
    model = lminvert.load_model("tiny-gpt2")
    results = find_collisions(model, corpus="prose", n_prompts=80, layers=[1, 2], max_tokens=8, out=tmp_path, k=5)
    assert not (tmp_path / "results.md").exists()  # computing draws nothing; the report stage does
    paths = lminvert.render(results)
    assert paths["markdown"] == str(tmp_path / "results.md") and paths["figure"] == str(tmp_path / "nn_distances.png")
    doc = json.loads((tmp_path / "results.json").read_text())
    for key in ("model", "n_prompts", "n_pairs", "layers", "pairs_per_second", "matmul_fraction", "config", "versions"):
        assert key in doc
    assert doc["n_pairs"] == 80 * 79 // 2 and set(doc["layers"]) == {"1", "2"}
    layer = doc["layers"]["2"]
    assert {"min_distance", "closest_pairs", "n_below_threshold", "nn_quantiles"} <= set(layer)
    assert len(layer["closest_pairs"]) == 5
    assert set(layer["closest_pairs"][0]) >= {"a_ids", "b_ids", "a_text", "b_text", "distance"}
    assert layer["nn_quantiles"]["0"] == pytest.approx(layer["min_distance"])
    assert sum(layer["nn_histogram"]["counts"]) + layer["nn_histogram"]["zeros"] == 80
    assert doc["config"]["seed"] == 0 and doc["versions"]["torch"] == torch.__version__
    assert doc["memory_peak_mb"] > 0 and doc["layers"]["1"]["search"]["matmul_fraction"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| layer | min distance" in table and f"{results.layers['1'].min_distance:.4g}" in table
    assert (tmp_path / "nn_distances.png").stat().st_size > 10_000
    states = np.load(tmp_path / "states" / "layer_002.npy")
    ids = [tuple(p["a_ids"]) for p in layer["closest_pairs"][:1]] + [tuple(layer["closest_pairs"][0]["b_ids"])]
    direct = [model.probe.states(torch.tensor([i]), 2)[2][0, -1].numpy() for i in ids]
    distance = float(np.linalg.norm(direct[0].astype(np.float64) - direct[1]))
    assert distance == pytest.approx(layer["min_distance"], rel=1e-3)  # the stored states are the last tokens'
    assert states.shape == (80, 64)


def _summary(doc: dict) -> dict:
    keep = ("min_distance", "closest_pairs", "n_below_threshold", "nn_quantiles", "nn_histogram", "nn_exact_count")
    return {name: {k: layer[k] for k in keep} for name, layer in doc["layers"].items()}


def test_resume_after_interruptions_gives_the_same_results(tmp_path, monkeypatch):
    model = lminvert.load_model("tiny-qwen2")
    kwargs = dict(corpus="mixed", n_prompts=120, layers="all", max_tokens=10, chunk_size=32)
    reference = find_collisions(model, out=tmp_path / "straight", **kwargs)

    original_write = StateStore.write_chunk
    calls = {"n": 0}

    def interrupted_write(self, chunk, rows):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        original_write(self, chunk, rows)

    monkeypatch.setattr(StateStore, "write_chunk", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        find_collisions(model, out=tmp_path / "resumed", **kwargs)
    monkeypatch.setattr(StateStore, "write_chunk", original_write)
    progress = json.loads((tmp_path / "resumed" / "states" / "progress.json").read_text())
    assert progress["done"] == [0, 1]

    original_task = run_module.run_layer_task
    written = []

    def counting_write(self, chunk, rows):
        written.append(chunk)
        original_write(self, chunk, rows)

    def interrupted_task(task):
        if task.layer == 2:
            raise KeyboardInterrupt
        return original_task(task)

    monkeypatch.setattr(StateStore, "write_chunk", counting_write)
    monkeypatch.setattr(run_module, "run_layer_task", interrupted_task)
    with pytest.raises(KeyboardInterrupt):
        find_collisions(model, out=tmp_path / "resumed", **kwargs)
    assert written == [2, 3]  # only the chunks the first attempt had not finished
    saved = json.loads((tmp_path / "resumed" / "search" / "layer_001.json").read_text())

    monkeypatch.setattr(run_module, "run_layer_task", original_task)
    resumed = find_collisions(model, out=tmp_path / "resumed", **kwargs)
    assert written == [2, 3] and resumed.to_dict()["timings"]["encoding_seconds"] == 0.0
    again = json.loads((tmp_path / "resumed" / "results.json").read_text())
    search = {k: v for k, v in again["layers"]["1"]["search"].items() if k != "matmul_fraction"}  # run-level
    assert search == saved["search"]  # layer 1 was loaded, not searched again
    straight = json.loads((tmp_path / "straight" / "results.json").read_text())
    assert _summary(again) == _summary(straight)
    assert resumed.min_distances == reference.min_distances
    assert (tmp_path / "resumed" / "prompts.jsonl").read_text() == (tmp_path / "straight" / "prompts.jsonl").read_text()
    for layer in (1, 2):
        name = f"layer_{layer:03d}.npy"
        assert np.array_equal(
            np.load(tmp_path / "resumed" / "states" / name), np.load(tmp_path / "straight" / "states" / name)
        )


def test_a_different_run_in_the_same_directory_is_refused(tmp_path):
    model = lminvert.load_model("tiny-llama")
    find_collisions(model, corpus="prose", n_prompts=20, layers=[1], max_tokens=6, out=tmp_path)
    with pytest.raises(LminvertError, match="different collisions run"):
        find_collisions(model, corpus="prose", n_prompts=20, layers=[1], max_tokens=6, out=tmp_path, seed=1)


def test_demo_collisions_returns_table_and_figure(tmp_path):
    model = lminvert.load_model("tiny-gemma3")
    results, paths = demo_collisions(model, tmp_path, n_prompts=40)
    assert list(results.layers) == ["1", "2"]  # first, middle and last block of a 2-block model
    assert Path(paths["markdown"]).read_text().startswith("# Collision search")
    assert paths["figure"].endswith(".png") and Path(paths["figure"]).exists()
    again, _ = demo_collisions(model, tmp_path, n_prompts=30)  # other settings: the demo's directory is replaced
    assert again.n_prompts == 30


def test_a_run_of_another_kind_is_refused(tmp_path):
    model = lminvert.load_model("tiny-llama")
    find_collisions(model, corpus="prose", n_prompts=20, layers=[1], max_tokens=6, out=tmp_path)
    with pytest.raises(LminvertError, match="holds a run of kind 'collisions', not 'exhaustive'"):
        exhaustive_test(model, [[1]], layers=[1], out=tmp_path)


@pytest.fixture(scope="module")
def small_vocab() -> LoadedModel:
    """A random Llama with a 300-token vocabulary (no tokenizer), tokens 5 and 9 sharing an embedding row."""
    model = small_vocab_llama()
    return LoadedModel.wrap("small-vocab", model)


def test_a_model_without_tokenizer_says_how_to_give_ids(small_vocab):
    with pytest.raises(LminvertError, match=r"has no tokenizer, so text cannot be encoded: give token ids"):
        small_vocab.tokenize("hello")
    assert small_vocab.decode([5, 9]) == "5 9"  # ids shown as numbers


def test_one_prefix_given_bare_is_one_prefix_and_an_unwritable_out_is_refused_first(small_vocab, tmp_path):
    """One prefix's ids as a flat list are one prefix (a text was one prefix per character), with the results of the
    same prefix in a list; a run directory that cannot be written, a size of the wrong type, and a states file that
    cannot be written are one-line errors before any work."""
    bare = exhaustive_test(small_vocab, [1, 2, 3], layers=[1], out=tmp_path / "bare", batch_size=100)
    listed = exhaustive_test(small_vocab, [[1, 2, 3]], layers=[1], out=tmp_path / "listed", batch_size=100)
    assert [p.ids for p in bare.prefixes] == [p.ids for p in listed.prefixes] == [(1, 2, 3)]
    assert bare.prefixes[0].layers["1"].min_distance == listed.prefixes[0].layers["1"].min_distance
    (tmp_path / "file").write_text("")
    with pytest.raises(LminvertError, match=r"cannot write into .*choose another --out"):
        exhaustive_test(small_vocab, [[1]], layers=[1], out=tmp_path / "file" / "run")
    with pytest.raises(LminvertError, match="max_tokens must be an int"):
        find_collisions(small_vocab, n_prompts=4, layers=[1], max_tokens="3", out=tmp_path / "c")
    states = HiddenStates.from_array(torch.zeros(2, 4))
    with pytest.raises(LminvertError, match=r"cannot write .*choose another path"):
        states.save(tmp_path / "file" / "s.safetensors")


def test_exhaustive_finds_the_planted_pair_and_matches_brute_force(small_vocab, tmp_path):
    results = exhaustive_test(small_vocab, [[1, 2, 3], [7]], layers="all", out=tmp_path, batch_size=64)
    assert results.n_pairs == 300 * 299 // 2 and len(results.prefixes) == 2
    for prefix in results.prefixes:
        for name, layer in prefix.layers.items():
            best = layer.closest_pairs[0]
            assert (best.a_index, best.b_index, best.distance) == (5, 9, 0.0), name
            assert layer.n_below_threshold == 1
    # the search over stored continuation states equals a float64 brute force on the same states
    states = np.load(tmp_path / "prefix_000" / "states" / "layer_002.npy").astype(np.float64)
    d2 = ((states[:, None] - states[None]) ** 2).sum(-1)
    d2[np.tril_indices(300)] = np.inf
    d2[5, 9] = np.inf  # the planted pair aside, the next closest must agree
    layer2 = results.prefixes[0].layers["2"]
    assert layer2.closest_pairs[1].distance == pytest.approx(np.sqrt(d2.min()), rel=1e-12)
    # the tied pair is reported apart: identical inputs by construction, not a counterexample
    assert layer2.closest_pairs[0].same_input and not layer2.closest_pairs[1].same_input
    assert layer2.details["tied_tokens"]["groups"] == [[5, 9]]
    assert layer2.details["inputs_differ"]["min_distance"] == pytest.approx(np.sqrt(d2.min()), rel=1e-12)
    assert layer2.details["inputs_differ"]["n_below_threshold"] == 0
    assert results.layers["2"]["n_below_threshold_inputs_differ"] == 0
    assert 0 <= layer2.details["rounding_noise"]["max"] < 1e-4
    # and the stored states are what a full forward gives for prefix + token
    full = small_vocab.probe.states(torch.tensor([[1, 2, 3, 42]]), 2)[2][0, -1].numpy()
    np.testing.assert_allclose(states[42], full, rtol=1e-4, atol=1e-5)
    assert results.layers["3"]["n_below_threshold"] == 2  # summed over the two prefixes
    lminvert.render(results)
    assert (tmp_path / "results.md").exists() and (tmp_path / "nn_distances.png").exists()


def test_exhaustive_default_layers_fit_any_depth(small_vocab, tmp_path):
    results = exhaustive_test(small_vocab, [[1]], out=tmp_path, batch_size=100)
    assert results.config.layers == ("1", "3")  # first, middle (3 // 2 = 1) and last block of a 3-block model


def test_exhaustive_resumes_and_refuses_other_runs(small_vocab, tmp_path, monkeypatch):
    first = exhaustive_test(small_vocab, [[4, 4]], layers=[1, 3], out=tmp_path, batch_size=100)
    calls = []
    original = StateStore.write_chunk
    monkeypatch.setattr(StateStore, "write_chunk", lambda self, c, rows: calls.append(c) or original(self, c, rows))
    again = exhaustive_test(small_vocab, [[4, 4]], layers=[1, 3], out=tmp_path, batch_size=100)
    assert calls == [] and again.extra["timings"]["encoding_seconds"] == 0.0  # nothing encoded twice
    assert again.to_dict()["layers"] == first.to_dict()["layers"]
    with pytest.raises(LminvertError, match="different exhaustive run"):
        exhaustive_test(small_vocab, [[4, 5]], layers=[1, 3], out=tmp_path, batch_size=100)


WORK = ("n_exact", "n_tiles_scanned", "blocks")  # what the search did, not what it found: depends on the split


def _found(path: Path) -> dict:
    """Every prefix and layer of an exhaustive results.json, without timings and work counters."""
    doc = json.loads((path / "results.json").read_text())
    return {
        (p["ids"][0], name): {
            key: ({k: v for k, v in value.items() if k not in WORK and "second" not in k and "flops" not in k
                   and k != "matmul_fraction"} if key == "search" else value)
            for key, value in layer.items()
        }
        for p in doc["prefixes"]
        for name, layer in p["layers"].items()
    }  # fmt: skip


def test_layers_split_into_row_blocks_give_the_same_run_and_resume_per_block(small_vocab, tmp_path, monkeypatch):
    kwargs = dict(layers="all", batch_size=64, tile_rows=32, progress=False)
    exhaustive_test(small_vocab, [[1, 2, 3]], out=tmp_path / "whole", **kwargs)
    searched: list[tuple[int, int]] = []
    original = tasks_module.search_block

    def interrupted(x, *args):
        if len(searched) == 5:
            raise KeyboardInterrupt
        searched.append(args[4])  # the rows of the block
        return original(x, *args)

    monkeypatch.setattr(tasks_module, "search_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exhaustive_test(small_vocab, [[1, 2, 3]], out=tmp_path / "split", block_pairs=5000, **kwargs)
    search_dir = tmp_path / "split" / "prefix_000" / "search"
    assert len(list(search_dir.glob("*.blocks/rows_*.npz"))) == 5  # the finished blocks are kept
    monkeypatch.setattr(tasks_module, "search_block", lambda x, *args: searched.append(args[4]) or original(x, *args))
    split = exhaustive_test(small_vocab, [[1, 2, 3]], out=tmp_path / "split", block_pairs=5000, **kwargs)
    blocks = row_blocks(300, 32, DEFAULT_TILE_COLS, 5000)
    assert len(blocks) > 4 and len(searched) == 3 * len(blocks)  # each block of the 3 layers searched once
    assert not list(search_dir.glob("*.blocks"))  # merged into the layers' files, then removed
    assert {json.loads(p.read_text())["search"]["blocks"] for p in search_dir.glob("layer_*.json")} == {len(blocks)}
    assert _files(tmp_path / "split") == _files(tmp_path / "whole")
    for name in _files(tmp_path / "whole"):
        if name.endswith(".npy"):
            assert np.load(tmp_path / "whole" / name).tobytes() == np.load(tmp_path / "split" / name).tobytes(), name
    assert _found(tmp_path / "split") == _found(tmp_path / "whole")
    assert split.prefixes[0].layers["2"].closest_pairs[0].distance == 0.0


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != "results.md"}


def test_pairs_per_block_defaults_to_one_task_in_process_and_fills_workers_on_ray():
    class Workers:
        name, workers, records = "ray", 4, []

    assert SearchSettings().pairs_per_block(get_executor(None), 100_000, 30) == 0
    assert SearchSettings().pairs_per_block(Workers(), 100_000, 2) == DEFAULT_BLOCK_PAIRS  # 2.5e9 pairs per worker
    assert SearchSettings().pairs_per_block(Workers(), 20_000, 1) == 24_998_750  # 2e8 pairs / 8: two tasks per worker
    assert SearchSettings().pairs_per_block(Workers(), 2_000, 1) == MIN_BLOCK_PAIRS
    assert SearchSettings(block_pairs=123).pairs_per_block(get_executor(None), 100_000, 30) == 123
    with pytest.raises(LminvertError, match="--block-pairs must be"):
        SearchSettings(block_pairs=-1)


def test_a_run_stopped_before_any_work_does_not_lock_its_directory(tmp_path):
    """Bad input refused after the manifest was written (a typo in --corpus) must not make the corrected command
    refuse the directory; once something was computed there, another run's config is refused."""
    from lminvert.runs import RunDirectory

    RunDirectory(tmp_path, "collisions", {"corpus": "nosuch"}, ["corpus"])
    run = RunDirectory(tmp_path, "collisions", {"corpus": "mixed"}, ["corpus"])
    assert not run.resumed
    run.step("store.json", lambda: {"done": 1})
    assert RunDirectory(tmp_path, "collisions", {"corpus": "mixed"}, ["corpus"]).resumed
    with pytest.raises(LminvertError, match="different collisions run"):
        RunDirectory(tmp_path, "collisions", {"corpus": "prose"}, ["corpus"])
