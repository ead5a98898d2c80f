"""`lminvert collisions` and `lminvert exhaustive` as a user runs them: outputs and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def test_collisions_json(cli, tmp_path):
    out = tmp_path / "run"
    proc = cli(
        "collisions",
        "--model",
        "tiny-gpt2",
        "--corpus",
        "prose",
        "--n-prompts",
        "40",
        "--layers",
        "1,-1",
        "--max-tokens",
        "6",
        "--k",
        "3",
        "--out",
        str(out),
        "--json",
        check=True,
    )
    doc = json.loads(proc.stdout)
    assert doc["n_prompts"] == 40 and doc["n_pairs"] == 780 and set(doc["layers"]) == {"1", "2"}
    assert len(doc["layers"]["2"]["closest_pairs"]) == 3
    assert doc["config"]["corpus"] == "prose" and doc["config"]["max_tokens"] == 6
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "nn_distances.png", "prompts.jsonl"}
    table = cli("collisions", "--model", "tiny-gpt2", "--corpus", "prose", "--n-prompts", "40", "--layers", "1,-1",
                "--max-tokens", "6", "--k", "3", "--out", str(out), check=True)  # fmt: skip
    assert "layer     2: min distance" in table.stdout and "pair(s) under 1e-06" in table.stdout  # resumed


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--corpus", "/no/such/corpus.jsonl"], "corpus '/no/such/corpus.jsonl' not found"),
        (["--corpus", "EMPTY"], "is empty"),
        (["--n-prompts", "1"], "--n-prompts must be at least 2"),
        (["--layers", "1,99"], "layer 99 is out of range"),
        (["--threshold", "-1"], "--threshold must be a non-negative number"),
    ],
)
def test_collisions_errors_are_one_line(cli, tmp_path, extra, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    extra = [str(empty) if x == "EMPTY" else x for x in extra]
    args = ["collisions", "--model", "tiny-llama", "--n-prompts", "10", "--out", str(tmp_path / "o"), *extra]
    proc = cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lminvert: error: ") and message in lines[0]


def test_exhaustive_from_collisions_on_a_local_model(cli, tmp_path):
    config = LlamaConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    run = tmp_path / "collisions"
    run.mkdir()
    pair = {"a_ids": [3, 4], "b_ids": [5], "a_text": "", "b_text": "", "distance": 0.5}
    (run / "results.json").write_text(json.dumps({"layers": {"1": {"closest_pairs": [pair]}}}))
    proc = cli(
        "exhaustive",
        "--model",
        str(tmp_path / "model"),
        "--from-collisions",
        str(run),
        "--prefixes",
        "2",
        "--layers",
        "all",
        "--out",
        str(tmp_path / "ex"),
        "--json",
        check=True,
    )
    doc = json.loads(proc.stdout)
    assert doc["vocab_size"] == 200 and doc["n_pairs"] == 200 * 199 // 2
    assert [p["ids"] for p in doc["prefixes"]] == [[3, 4], [5]]
    assert set(doc["layers"]) == {"1", "2"} and doc["layers"]["2"]["min_distance"] > 0
    # default layers (first, middle, last block) fit a model of any depth: here 2 blocks
    args = ["--model", str(tmp_path / "model"), "--from-collisions", str(run), "--out", str(tmp_path / "d")]
    proc = cli("exhaustive", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["layers"] == ["1", "2"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--from-collisions", "/no/such/run"], "no results.json in /no/such/run"),
        (["--prefix", "hi", "--layers", "0,x"], "layer 'x' is not a layer"),
        (["--prefix", "hi", "--prefixes", "0"], "--prefixes must be at least 1"),
    ],
)
def test_exhaustive_errors_are_one_line(cli, tmp_path, extra, message):
    proc = cli("exhaustive", "--model", "tiny-llama", "--out", str(tmp_path / "o"), *extra)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
