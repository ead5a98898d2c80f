"""The Ray executor against the in-process one: the same minima, pairs, inversions and rows, the same directory
layout; a worker killed mid-task; a driver interrupted and resumed under the other executor; CLI errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lminvert
from lminvert import experiments
from lminvert.collisions import exhaustive_test, find_collisions
from lminvert.collisions.store import StateStore
from lminvert.errors import LminvertError
from lminvert.executors import ModelSetup, get_executor, ordered
from lminvert.models.loading import resolve_device

from ..conftest import small_vocab_llama

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'lminvert[ray]' (make test installs it)")

from lminvert.ray_executor import RayExecutor  # noqa: E402  (imports Ray)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def on_ray(cluster) -> RayExecutor:
    runner = get_executor("ray")
    assert isinstance(runner, RayExecutor) and runner.workers == 2
    return runner


@pytest.fixture(scope="module")
def tiny():
    return lminvert.load_model("tiny-llama", device="auto")  # each worker resolves auto itself


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A random Llama with a 300-token vocabulary, saved to a directory (workers load it from there)."""
    model = small_vocab_llama()
    directory = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(directory)
    return lminvert.load_model(str(directory))


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


TIMING = ("seconds", "per_second", "fraction", "flops", "matmul")  # keys that measure speed, not results
WORK = ("n_exact", "n_tiles_scanned", "blocks")  # what a split search did (pairs re-measured), not what it found


def _stable(value: Any, skip: tuple[str, ...] = ()) -> Any:
    """``value`` without the keys that measure how fast it was computed, or how the search was split (or ``skip``)."""
    if isinstance(value, dict):
        drop = (*TIMING, *skip)
        return {k: _stable(v, skip) for k, v in value.items() if not any(t in k for t in drop) and k not in WORK}
    if isinstance(value, list):
        return [_stable(v, skip) for v in value]
    return value


def _same_run(a: Path, b: Path) -> None:
    """Two run directories: the same files, the same states and NN distances, the same layer results."""
    assert _files(a) == _files(b)
    for path in sorted(_files(a)):
        if path.endswith(".npy"):
            assert np.array_equal(np.load(a / path), np.load(b / path)), path
    doc_a, doc_b = (json.loads((d / "results.json").read_text()) for d in (a, b))
    for key in ("layers", "prefixes"):
        assert _stable(doc_a.get(key)) == _stable(doc_b.get(key)), key


def _differs(a: Any, b: Any, rel: float = 1e-5, at: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (None: equal but for floats, which agree to ``rel``)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return next((d for k in a if (d := _differs(a[k], b[k], rel, f"{at}.{k}")) is not None), None)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return next((d for i, (x, y) in pairs if (d := _differs(x, y, rel, f"{at}[{i}]")) is not None), None)
    if isinstance(a, float) and isinstance(b, float):
        return None if a == pytest.approx(b, rel=rel, abs=1e-12) else f"{at}: {a} != {b}"
    return None if a == b else f"{at}: {a!r} != {b!r}"


def _close_run(a: Path, b: Path) -> None:
    """:func:`_same_run` to float32's resolution: where a worker's forwards may round differently from this process's
    (a real model's GEMMs blocked by another thread count on a CPU with AMX)."""
    assert _files(a) == _files(b)
    for path in sorted(_files(a)):
        if path.endswith(".npy"):
            x, y = np.load(a / path), np.load(b / path)
            if np.issubdtype(x.dtype, np.floating):
                assert np.allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(x).max(initial=0.0))), path
            else:
                assert np.array_equal(x, y), path
    doc_a, doc_b = (json.loads((d / "results.json").read_text()) for d in (a, b))
    skip = ("error", "rounding")  # not the measured rounding (spot checks, rounding noise): it measures the rounding
    for key in ("layers", "prefixes"):
        found = _differs(_stable(doc_a.get(key), skip), _stable(doc_b.get(key), skip))
        assert found is None, found


def _collisions(model, out: Path, executor: Any = None, **split: Any):
    return find_collisions(
        model, corpus="code", n_prompts=48, layers="all", max_tokens=8, chunk_size=16, out=out,
        executor=executor, progress=False, **split,
    )  # fmt: skip


SPLIT = {"tile_rows": 8, "block_pairs": 200}  # 48 prompts: 5 row blocks of 1 or 2 tile rows per layer


def test_collisions_are_the_same_on_ray(tiny, on_ray, tmp_path):
    here = _collisions(tiny, tmp_path / "here")
    there = _collisions(tiny, tmp_path / "ray", on_ray)
    assert there.layer_minima() == here.layer_minima()
    for name, layer in here.layers.items():
        assert there.layers[name].closest_pairs == layer.closest_pairs
    _same_run(tmp_path / "here", tmp_path / "ray")
    workers = {r.worker for r in on_ray.records}
    assert len(workers) == 2  # both workers took tasks


def test_layers_split_into_row_blocks_on_ray_equal_one_task_in_process(tiny, on_ray, tmp_path):
    here = _collisions(tiny, tmp_path / "here", tile_rows=8)  # one task per layer
    on_ray.records.clear()
    there = _collisions(tiny, tmp_path / "ray", on_ray, **SPLIT)
    assert there.layer_minima() == here.layer_minima()
    for name, layer in here.layers.items():
        assert there.layers[name].closest_pairs == layer.closest_pairs
        assert there.layers[name].details["search"]["blocks"] == 5
    _same_run(tmp_path / "here", tmp_path / "ray")
    assert len(on_ray.records) == 3 + 2 * 5 + 2  # encoding chunks, the blocks of 2 layers, their merges


def test_exhaustive_is_the_same_on_ray(small_vocab, on_ray, tmp_path):
    kwargs = {"layers": "all", "batch_size": 64, "progress": False}
    here = exhaustive_test(small_vocab, [[1, 2, 3], [7]], out=tmp_path / "here", **kwargs)
    there = exhaustive_test(small_vocab, [[1, 2, 3], [7]], out=tmp_path / "ray", executor=on_ray, **kwargs)
    assert there.layer_minima() == here.layer_minima()
    for a, b in zip(here.prefixes, there.prefixes, strict=True):
        for name in a.layers:
            assert b.layers[name].closest_pairs == a.layers[name].closest_pairs
            assert (a.layers[name].closest_pairs[0].a_index, a.layers[name].closest_pairs[0].b_index) == (5, 9)
    _same_run(tmp_path / "here", tmp_path / "ray")


def test_inversions_are_the_same_on_ray(tiny, on_ray):
    texts = ["the cat sat", "def f(x): return x", "hello world", "a b c d", "one two"]
    states = lminvert.encode(tiny, texts, layer=1, keep_ids=True)
    here = lminvert.invert(tiny, states, together=2)
    there = lminvert.invert(tiny, states, together=2, executor=on_ray)
    assert [r.token_ids for r in there] == [r.token_ids for r in here] == [list(x) for x in states.token_ids]
    assert [r.candidates_checked for r in there] == [r.candidates_checked for r in here]


def test_experiment_rows_are_the_same_on_ray(on_ray, tmp_path):
    kwargs = {"quick": True, "models": ("tiny-llama",), "progress": False, "prompts": 2, "length": 4}
    here = experiments.run("vocabulary", tmp_path / "here", **kwargs)
    there = experiments.run("vocabulary", tmp_path / "ray", executor=on_ray, **kwargs)
    drop = ("seconds", "time", "per_token")
    clean = lambda rows: [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows]  # noqa: E731
    assert clean(there["rows"]) == clean(here["rows"])
    assert there["models_info"]["tiny-llama"]["weights_hash"] == here["models_info"]["tiny-llama"]["weights_hash"]
    assert sorted(p.name for p in (tmp_path / "ray" / "units").iterdir()) == sorted(
        p.name for p in (tmp_path / "here" / "units").iterdir()
    )


def test_real_model_collisions_on_ray(smollm2, on_ray, tmp_path):
    """A small job on the default model: each worker loads it once and the minima agree."""
    kwargs = {"corpus": "mixed", "n_prompts": 24, "layers": "1,-1", "max_tokens": 8, "chunk_size": 8}
    here = find_collisions(smollm2, out=tmp_path / "here", progress=False, **kwargs)
    there = find_collisions(smollm2, out=tmp_path / "ray", executor=on_ray, progress=False, **kwargs)
    # the same pairs, and the same minima to float32's resolution (a worker's GEMMs may block by another thread count)
    mine, theirs = here.layer_minima(), there.layer_minima()
    assert mine.keys() == theirs.keys()
    for layer, (distance, *rest) in mine.items():
        assert theirs[layer][0] == pytest.approx(distance, rel=1e-5) and list(theirs[layer][1:]) == rest
    _close_run(tmp_path / "here", tmp_path / "ray")


class DiesOnce:
    """A task function whose first call kills its own worker process (SIGKILL), mid-task."""

    def __init__(self, fn: Any, marker: Path) -> None:
        self.fn, self.marker = fn, str(marker)

    def __call__(self, state: Any, task: Any) -> Any:
        if not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.fn(state, task)


class Faulty:
    """The Ray executor with a fault: a worker killed in the first task of each map, or the driver stopped
    (KeyboardInterrupt) after the first result."""

    name = "ray"

    def __init__(self, inner: RayExecutor, marker_dir: Path, interrupt: bool = False) -> None:
        self.inner, self.marker_dir, self.interrupt, self.calls = inner, marker_dir, interrupt, 0
        self.records, self.workers = inner.records, inner.workers

    def map(self, fn, tasks):
        from lminvert.executors import Plain, ordered

        return ordered(self.map_with(None, Plain(fn), tasks), len(tasks))

    def map_with(self, setup, fn, tasks):
        self.calls += 1
        stream = self.inner.map_with(setup, DiesOnce(fn, self.marker_dir / f"killed-{self.calls}"), tasks)
        for index, result in stream:
            yield index, result
            if self.interrupt:
                raise KeyboardInterrupt


def test_a_killed_worker_is_restarted_and_the_run_is_the_same(tiny, on_ray, tmp_path):
    here = _collisions(tiny, tmp_path / "here", tile_rows=8)
    faulty = Faulty(on_ray, tmp_path)
    there = _collisions(tiny, tmp_path / "ray", faulty, **SPLIT)
    killed = sorted(tmp_path.glob("killed-*"))
    assert len(killed) == 3  # one worker killed while encoding, one in a row block, one merging a layer
    # the same pairs, and the same minima to float32's resolution (a worker's GEMMs may block by another thread count)
    mine, theirs = here.layer_minima(), there.layer_minima()
    assert mine.keys() == theirs.keys()
    for layer, (distance, *rest) in mine.items():
        assert theirs[layer][0] == pytest.approx(distance, rel=1e-5) and list(theirs[layer][1:]) == rest
    _close_run(tmp_path / "here", tmp_path / "ray")


def test_an_interrupted_ray_run_resumes_in_process(tiny, on_ray, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _collisions(tiny, tmp_path / "run", Faulty(on_ray, tmp_path, interrupt=True))
    store = json.loads((tmp_path / "run" / "states" / "progress.json").read_text())
    assert 1 <= len(store["done"]) < 3  # the chunk that arrived is kept
    resumed = _collisions(tiny, tmp_path / "run")  # the same directory, in this process
    fresh = _collisions(tiny, tmp_path / "fresh")
    assert resumed.layer_minima() == fresh.layer_minima()
    _same_run(tmp_path / "run", tmp_path / "fresh")
    assert StateStore(tmp_path / "run" / "states", 48, 64, [1, 2], 16).complete


class AlwaysDies:
    """A task function that kills its worker process every time it runs."""

    def __call__(self, state: Any, task: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


def test_worker_deaths_are_limited_per_task_not_over_the_pool_life(cluster, tmp_path):
    single = RayExecutor(workers=1, cpus_per_worker=0, retries=1)  # one actor: every death is its own
    try:
        for call in range(single.retries + 2):  # more deaths in all than one task may retry
            killer = DiesOnce(lambda state, task: task * 10, tmp_path / f"killed-{call}")
            assert ordered(single.map_with(None, killer, [call]), 1) == [call * 10]
        assert len(list(tmp_path.glob("killed-*"))) == single.retries + 2
        with pytest.raises(LminvertError, match=r"a Ray worker died 2 times running the same task .* rerun"):
            list(single.map_with(None, AlwaysDies(), [0]))
    finally:
        single.close()


def test_device_auto_is_resolved_by_each_worker(tiny, on_ray):
    setup = ModelSetup.of(tiny)
    assert setup.device == "auto" and ModelSetup.of(lminvert.load_model("tiny-llama")).device == "cpu"
    made = ordered(on_ray.map_with(setup, lambda model, task: (str(model.device), model.weights_hash), [0, 1]), 2)
    assert made == [(str(resolve_device("auto")), tiny.weights_hash)] * 2  # this machine: the CPU


def test_a_model_made_in_memory_is_refused_on_workers(tiny, on_ray):
    wrapped = lminvert.LoadedModel.wrap("edited-in-memory", tiny.model, tiny.tokenizer)
    with pytest.raises(LminvertError, match="made in memory cannot be sent to workers"):
        list(on_ray.map_with(ModelSetup.of(wrapped), lambda model, task: task, [1]))


def _cli(*args: str, env: dict[str, str] | None = None, block_ray: bool = False) -> subprocess.CompletedProcess:
    code = "import sys; from lminvert.cli import main; sys.exit(main(sys.argv[1:]))"
    if block_ray:
        code = "import sys; sys.modules['ray'] = None; " + code
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_on_the_running_cluster_writes_the_same_directory(tiny, on_ray, tmp_path):
    on_ray.close()  # free the cluster's two CPUs for the command's own workers
    address = ray.get_runtime_context().gcs_address
    common = ["collisions", "--model", "tiny-llama", "--corpus", "code", "--n-prompts", "48", "--layers", "all",
              "--max-tokens", "8", "--no-figure", "--json"]  # fmt: skip
    proc = _cli(*common, "--out", str(tmp_path / "ray"), "--ray", address)
    assert proc.returncode == 0, proc.stderr
    here = _cli(*common, "--out", str(tmp_path / "here"))
    assert here.returncode == 0, here.stderr
    assert _stable(json.loads(proc.stdout)["layers"]) == _stable(json.loads(here.stdout)["layers"])
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["config"]["executor"] == "ray"


@pytest.mark.parametrize(
    ("ray_arg", "block", "message"),
    [
        ("", True, "--ray needs Ray: pip install 'lminvert[ray]'"),
        ("127.0.0.1:1", False, "no Ray cluster at 127.0.0.1:1"),
        ("nonsense", False, "bad Ray address 'nonsense'"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, ray_arg, block, message):
    args = ["exhaustive", "--model", "tiny-llama", "--prefix", "hi", "--out", str(tmp_path / "x"), "--ray"]
    proc = _cli(*args, *([ray_arg] if ray_arg else []), block_ray=block, env={"RAY_ADDRESS": ""})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lminvert: error: ") and message in lines[0], proc.stderr
