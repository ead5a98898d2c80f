"""The command line as a user runs it: output schema and one-line errors with a non-zero exit."""

from __future__ import annotations

import json

import numpy as np
import pytest


def test_models_lists_aliases(cli):
    proc = cli("models", "--json", check=True)
    rows = {r["alias"]: r for r in json.loads(proc.stdout)}
    assert rows["smollm2-135m"]["layers"] == 30 and rows["smollm2-135m"]["vocab_size"] == 49152
    assert rows["gpt2-small-random"]["hidden_size"] == 768


def test_encode_json(cli, tmp):
    out = tmp / "s.safetensors"
    proc = cli(
        "encode",
        "--model",
        "tiny-llama",
        "--layer",
        "1",
        "--text",
        "hello there",
        "--text",
        "bye",
        "--out",
        str(out),
        "--json",
        check=True,
    )
    doc = json.loads(proc.stdout)
    assert set(doc) == {"model", "layer", "out", "prompts"}
    assert doc["layer"] == "1" and len(doc["prompts"]) == 2
    assert all(p["n_tokens"] == len(p["token_ids"]) > 0 for p in doc["prompts"])
    assert out.is_file()


def test_encode_file_jsonl(cli, tmp):
    src = tmp / "p.jsonl"
    src.write_text('{"text": "one two three"}\n\n{"text": "four"}\n')
    proc = cli(
        "encode",
        "--model",
        "tiny-gpt2",
        "--layer",
        "-1",
        "--file",
        str(src),
        "--max-tokens",
        "2",
        "--out",
        str(tmp / "s.safetensors"),
        "--json",
        check=True,
    )
    assert [p["n_tokens"] for p in json.loads(proc.stdout)["prompts"]] == [2, 1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "nonsense", "--layer", "1", "--text", "x"], "Known aliases"),
        (["--model", "tiny-llama", "--layer", "7", "--text", "x"], "0..2"),
        (["--model", "tiny-llama", "--layer", "1", "--text", "  "], "empty text"),
        (["--model", "tiny-llama", "--layer", "1", "--file", "/no/such.txt"], "not found"),
        (["--model", "/no/such/dir", "--layer", "1", "--text", "x"], "model directory not found"),
        (["--model", "someorg/no-such-model", "--layer", "1", "--text", "x"], "not in the local Hugging Face cache"),
    ],
)
def test_encode_errors(cli, tmp, args, needle):
    proc = cli("encode", *args, "--out", str(tmp / "s.safetensors"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_empty_prompt_file(cli, tmp):
    src = tmp / "p.txt"
    src.write_text("\n\n")
    proc = cli(
        "encode", "--model", "tiny-llama", "--layer", "1", "--file", str(src), "--out", str(tmp / "s.safetensors")
    )
    assert proc.returncode == 2 and "no prompts" in proc.stderr


def test_nan_states_rejected_by_loader(tmp):
    from lminvert.errors import LminvertError
    from lminvert.states import HiddenStates

    arr = np.ones((4, 64), np.float32)
    arr[2, 3] = np.inf
    np.save(tmp / "x.npy", arr)
    with pytest.raises(LminvertError, match="NaN or inf"):
        HiddenStates.load(tmp / "x.npy")
