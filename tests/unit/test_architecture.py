"""The guarantees the code's shape gives: stages that import one way, one layer resolver, independent models, safe
caches, outputs checked first."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import grimp
import pytest
import torch
from safetensors.torch import load_file

import lminvert
from lminvert.errors import LminvertError
from lminvert.models import Layer, parse_layers
from lminvert.paths import atomic_dir, atomic_file

ROOT = Path(__file__).resolve().parents[2]


def test_stages_import_one_way():
    """The layers of docs/architecture.md, as the import-linter contract in pyproject.toml states them."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_no_module_imports_the_package_root():
    """The root imports every stage: a module that imports it imports them all."""
    graph = grimp.build_graph("lminvert")
    modules = sorted(m for m in graph.modules if m != "lminvert")
    assert [m for m in modules if "lminvert" in graph.find_modules_directly_imported_by(m)] == []


def test_layer_specs_resolve_in_one_place():
    assert parse_layers("all", 4) == [1, 2, 3, 4]
    assert parse_layers("1,middle,-1", 30) == [1, 15, 30]
    assert parse_layers("1,middle,-1", 2) == [1, 2]  # the defaults fit a model of any depth
    assert parse_layers([0, "final", -2], 4) == [0, 3, 5]
    final = parse_layers("final", 4)[0]
    assert final.is_final and final.name == "final" and final.top_block == 4
    assert [layer.name for layer in parse_layers("0,2", 4)] == ["0", "2"]
    assert pickle.loads(pickle.dumps(final)).name == "final"  # executors ship layers to workers
    for bad, needle in [("5", "out of range"), ("x", "is not a layer"), ("", "no layers given"), (5.5, "not a layer")]:
        with pytest.raises(LminvertError, match=needle):
            parse_layers(bad, 4)
    with pytest.raises(LminvertError, match="belongs to a model with 30 layers"):
        parse_layers([Layer(3, 30)], 4)


def test_load_model_gives_independent_objects_and_keeps_the_callers_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = lminvert.load_model("tiny-llama")
    b = lminvert.load_model("tiny-llama")
    assert torch.equal(torch.rand(3), expected)  # loading (seeded init) did not reseed the caller's generator
    assert a is not b and a.model is not b.model and a.weights_hash == b.weights_hash
    with torch.no_grad():
        a.probe.embedding.weight[0] += 1.0
    assert not torch.equal(a.probe.embedding.weight[0], b.probe.embedding.weight[0])  # no shared mutable model
    assert lminvert.LoadedModel.wrap("edited", a.model, a.tokenizer).weights_hash != b.weights_hash


def test_compute_takes_loaded_models_only():
    with pytest.raises(LminvertError, match=r"lminvert\.load_model"):
        lminvert.invert("tiny-llama", torch.zeros(2, 64))
    with pytest.raises(LminvertError, match=r"lminvert\.load_model"):
        lminvert.find_collisions("tiny-llama", n_prompts=4)


def test_interleaved_writers_never_share_a_temporary_file(tmp_path):
    """The interleaving a race produces, made deterministic: a second writer starts and finishes inside the first."""
    target = tmp_path / "table.bin"
    with atomic_file(target) as first:
        first.write_bytes(b"A" * 1000)
        with atomic_file(target) as second:
            assert second != first  # unique names: the second writer cannot truncate the first one's file
            second.write_bytes(b"B" * 1000)
        assert target.read_bytes() == b"B" * 1000  # readers only ever see a complete file
        assert first.read_bytes() == b"A" * 1000
    assert target.read_bytes() == b"A" * 1000 and [p.name for p in tmp_path.iterdir()] == ["table.bin"]
    directory = tmp_path / "model"
    with atomic_dir(directory) as slow:
        (slow / "weights").write_text("slow")
        with atomic_dir(directory) as fast:
            (fast / "weights").write_text("fast")
        assert (directory / "weights").read_text() == "fast"
    assert (directory / "weights").read_text() == "fast"  # the finished copy is kept, the late one discarded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "table.bin"]


_PREPARE_TABLE = """
import sys, time
import lminvert
from lminvert.invert.tables import first_position_table
model = lminvert.load_model("tiny-llama")
layer = model.probe.layer(1)
while time.time() < float(sys.argv[1]):  # start together
    time.sleep(0.005)
table = first_position_table(model, layer, progress=False)
print(float(table.double().sum()))
"""


def _together(script: str, cache: Path, extra_args: list[str] | None = None, n: int = 2) -> list[str]:
    env = {**os.environ, "LMINVERT_CACHE": str(cache)}
    start = str(time.time() + 8.0)  # both processes import torch first, then race
    procs = [
        subprocess.Popen(
            [sys.executable, *(["-c", script, start] if extra_args is None else extra_args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        outs.append(out.strip())
    return outs


def test_two_processes_prepare_the_same_table_at_once(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    # the tokenizer the random models borrow comes from the converted default model; share it, as a user's cache would
    real = Path(os.environ.get("LMINVERT_CACHE") or Path.home() / ".cache" / "lminvert")
    (cache / "models").mkdir()
    (cache / "models" / "smollm2-135m").symlink_to(real / "models" / "smollm2-135m")
    sums = _together(_PREPARE_TABLE, cache, n=3)
    assert len(set(sums)) == 1
    tables = [p for p in (cache / "tables").iterdir() if not p.name.endswith(".lock")]
    assert len(tables) == 1 and tables[0].name.endswith("layer1.safetensors")  # no temporary file left behind
    assert [p.name for p in (cache / "tables").glob(".*.lock")] == [f".{tables[0].name}.lock"]  # one built it
    (value,) = load_file(str(tables[0])).values()
    assert float(value.double().sum()) == float(sums[0])  # the file holds what both processes computed
    model = lminvert.load_model("tiny-llama")
    assert value.shape == (model.probe.vocab_size, model.probe.hidden_size)


def test_two_processes_convert_the_same_model_at_once(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    args = ["-m", "lminvert", "models", "--prepare", "smollm2-135m", "--no-signature", "--no-inversion"]  # conversion
    outs = _together("", cache, extra_args=args)
    assert all("ready" in out for out in outs)
    entries = sorted(p.name for p in (cache / "models").iterdir())
    assert entries == ["smollm2-135m"]  # one finished directory, no temporary one left
    env = {**os.environ, "LMINVERT_CACHE": str(cache)}
    check = "import lminvert; m = lminvert.load_model(); print(m.weights_hash)"
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == lminvert.load_model().weights_hash


@pytest.mark.parametrize(
    "command",
    [
        ["encode", "--model", "tiny-llama", "--layer", "1", "--text", "hi", "--out", "/proc/lminvert/x.safetensors"],
        ["invert", "STATES", "--out", "/proc/lminvert/x.json"],
        ["collisions", "--model", "tiny-llama", "--n-prompts", "10", "--out", "/proc/lminvert/run"],
        ["exhaustive", "--model", "tiny-llama", "--prefix", "hi", "--out", "/proc/lminvert/run"],
        ["demo", "--out", "/proc/lminvert/demo"],
    ],
)
def test_an_unwritable_out_is_refused_before_any_work(cli, tmp_path, command, monkeypatch):
    states = tmp_path / "s.safetensors"
    lminvert.encode(lminvert.load_model("tiny-llama"), ["hello there"], 1).save(states)
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("LMINVERT_CACHE", str(cache))
    args = [str(states) if x == "STATES" else x for x in command]
    proc = cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lminvert: error: cannot write") and "--out" in lines[0]
    assert not cache.exists() or not any(cache.rglob("*"))  # nothing was built, converted or extracted there


def test_a_conversion_parses_the_gguf_file_once(monkeypatch, tmp_path):
    """transformers' GGUF loading asks ``gguf`` for a reader of the same file three times and for the same tensor-name
    map once per module: within a conversion each is made once per file (or arguments) and shared; outside it, the
    library's own functions are back."""
    import gguf

    from lminvert.models.sources import gguf_parsed_once

    made: list[tuple[str, str]] = []

    class Reader:
        def __init__(self, path, mode="r"):
            made.append((str(path), mode))

    maps: list[tuple] = []
    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, blocks: maps.append((arch, blocks)) or object())
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    with gguf_parsed_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first and gguf.GGUFReader(b) is not first
        assert gguf.get_tensor_name_map(1, 30) is gguf.get_tensor_name_map(1, 30)
        gguf.get_tensor_name_map(1, 2)
    assert made == [(str(a), "r"), (str(b), "r")] and maps == [(1, 30), (1, 2)]
    assert gguf.GGUFReader is Reader and gguf.GGUFReader(a) is not first  # restored: a new reader each call again
