"""Cache entries record what made them (torch and transformers versions, CPU features, GPU, numeric path); one made
under another provenance is recomputed, never reused (a reading network, which only orders candidates, is used with
a warning); an entry kept for every device type (a radius) is also recomputed on another machine."""

from __future__ import annotations

import json
import logging
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import lminvert
from lminvert.invert import tables
from lminvert.invert.tables import cached, first_position_table, provenance, read_tables, table_path
from lminvert.runs import machine


def test_an_entry_made_under_another_provenance_is_recomputed(isolated_cache, monkeypatch, caplog):
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    table = first_position_table(model, layer, progress=False)
    path = table_path(model, layer, "table")
    with safe_open(str(path), framework="pt") as handle:
        made = json.loads(handle.metadata()["provenance"])
    assert made == provenance(model)
    assert made["torch"] == torch.__version__ and made["numeric"] == "native" and made["cpu"]
    assert read_tables(lminvert.load_model("tiny-llama"), layer, "table") is not None

    monkeypatch.setattr(tables, "provenance", lambda m: {**made, "torch": "0.0"})  # another torch made it
    fresh = lminvert.load_model("tiny-llama")  # a new loaded model: nothing in memory
    with caplog.at_level(logging.INFO, logger="lminvert.invert.tables"):
        assert read_tables(fresh, layer, "table") is None
    assert "recomputing" in caplog.text and "torch" in caplog.text
    calls = []
    cached(fresh, layer, "table", lambda: calls.append(1) or table)
    assert calls == [1]
    caplog.clear()
    monkeypatch.setattr(tables, "provenance", lambda m: {**made, "cpu": "another"})
    with caplog.at_level(logging.WARNING, logger="lminvert.invert.tables"):
        assert read_tables(fresh, layer, "table", strict=False) is not None  # what a reading network asks for
    assert "another ['torch']" in caplog.text  # the file above was rewritten under torch 0.0

    monkeypatch.setattr(tables, "provenance", lambda m: {**made, "torch": "0.0", "cpu": "another", "gpu": "H100"})
    assert read_tables(fresh, layer, "table") is not None  # a table only orders candidates: any machine's serves
    cached(fresh, layer, "radius", lambda: torch.ones(1), per_device=True)
    monkeypatch.setattr(tables, "provenance", lambda m: {**made, "torch": "0.0"})
    assert read_tables(fresh, layer, "radius", "cpu") is None  # a radius is measured on the kernels that round

    monkeypatch.setattr(tables, "provenance", provenance)
    save_file({"value": table.cpu()}, str(path))  # an entry from before provenance was recorded
    assert read_tables(lminvert.load_model("tiny-llama"), layer, "table") is None


def test_results_record_the_cpu_features():
    features = machine()["cpu_features"]
    assert features.split()[0] == torch.backends.cpu.get_cpu_capability()


def test_results_record_the_versions_features_and_numeric_path():
    from lminvert.runs import run_metadata

    model = lminvert.load_model("tiny-llama")
    meta = run_metadata(model.describe(), seed=0)
    assert meta["versions"]["torch"] == torch.__version__ and meta["machine"]["cpu_features"]
    assert meta["model_info"]["numeric_path"] == "native"


def test_the_numeric_path_follows_the_cpu_features_not_a_timing(monkeypatch):
    """A half model's cached forwards run as float32 GEMMs exactly where the CPU has no units for its dtype: a fact of
    the machine (recorded with every cache entry), the same in every process, whatever the load."""
    from lminvert.models import halfmath

    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2"}))
    assert lminvert.load_model("tiny-llama", dtype="bfloat16").probe.numeric_path == "half-as-float32"
    assert not halfmath.native_bfloat16(torch.device("cpu")) and halfmath.native_bfloat16(torch.device("cuda"))
    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert lminvert.load_model("tiny-llama", dtype="bfloat16").probe.numeric_path == "native"
    assert halfmath.half_is_slow(torch.float16) and not halfmath.half_is_slow(torch.bfloat16)
    assert lminvert.load_model("tiny-llama").probe.numeric_path == "native"  # float32 is never replaced


def test_several_layers_tables_are_built_in_one_pass_and_equal_one_layers(isolated_cache, monkeypatch):
    """:func:`first_position_tables` builds the tables not kept in one pass of the vocabulary (the audit's units read
    several layers' tables); each is the one a layer's own pass gives, and one already kept is read, not rebuilt."""
    model = lminvert.load_model("tiny-llama")
    layers = [model.probe.layer(i) for i in (0, 1, 2)]
    kept = first_position_table(model, layers[1], progress=False)
    passes: list[list[int]] = []
    real = tables.vocabulary_states

    def counted(m, prefix, wanted, **kwargs):
        passes.append([int(x) for x in wanted])
        return real(m, prefix, wanted, **kwargs)

    monkeypatch.setattr(tables, "vocabulary_states", counted)
    together = tables.first_position_tables(model, layers, progress=False)
    assert passes == [[0, 2]]  # layer 1 was kept already
    assert torch.equal(together[layers[1]], kept)
    fresh = lminvert.load_model("tiny-llama")
    monkeypatch.setattr(tables, "read_tables", lambda *a, **k: None)  # nothing kept: each layer's own pass
    for layer in layers:
        alone = first_position_table(fresh, layer, progress=False)
        assert torch.equal(together[layer], alone)
        fresh.memo.clear()
    assert len(passes) == 1 + len(layers)


def test_an_entry_another_process_is_building_is_waited_for_and_read_not_built_again(isolated_cache, caplog):
    """While another holder builds a cache entry (here a thread holding its lock, as another process would), asking
    for it waits, then reads what that one wrote instead of building it a second time; an entry asked for inside a
    build takes no lock of its own (one held per process at most: two never wait on each other)."""
    import threading

    from lminvert.paths import building

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    path = table_path(model, layer, "waited")
    holding, done, got = threading.Event(), threading.Event(), {}

    def other() -> None:
        with building(path) as waited:
            holding.set()
            done.wait(30)
            tables.write_tables(model, layer, "waited", {"value": torch.arange(3.0)})
        got["waited"] = waited

    thread = threading.Thread(target=other)
    thread.start()
    assert holding.wait(30)
    timer = threading.Timer(0.5, done.set)  # the other build ends after half a second
    timer.start()
    with caplog.at_level(logging.INFO, logger="lminvert.paths"):
        value = cached(model, layer, "waited", lambda: (_ for _ in ()).throw(AssertionError("built twice")))
    thread.join(30)
    assert torch.equal(value.cpu(), torch.arange(3.0)) and got["waited"] is False
    assert any("waiting for another process" in r.getMessage() for r in caplog.records)
    nested = cached(model, layer, "outer", lambda: cached(model, layer, "inner", lambda: torch.ones(2)) + 1)
    assert torch.equal(nested.cpu(), torch.full((2,), 2.0))

    def lock_of(kind: str) -> bool:
        entry = table_path(model, layer, kind)
        return (entry.parent / f".{entry.name}.lock").exists()

    assert lock_of("outer") and not lock_of("inner")


def test_radii_another_process_is_measuring_are_waited_for_and_read(isolated_cache, monkeypatch):
    """The radii's calibration keeps several entries from one measurement: while another holder measures them, a
    caller waits and reads them rather than measuring them again."""
    import threading

    from lminvert.invert import tolerance

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    kind = tolerance.calibration_kind(model)
    holding, done = threading.Event(), threading.Event()
    radii = torch.tensor([1e-6, 2e-6, 0.5, 36.0], dtype=torch.float64)

    def other() -> None:
        with tables.build_lock(model, layer, kind, per_device=True):
            holding.set()
            done.wait(30)
            tables.write_tables(model, layer, kind, {"value": radii}, model.device.type)

    thread = threading.Thread(target=other)
    thread.start()
    assert holding.wait(30)
    monkeypatch.setattr(tolerance, "measure_layers", lambda *a, **k: (_ for _ in ()).throw(AssertionError("twice")))
    threading.Timer(0.5, done.set).start()
    assert tolerance.calibrate_layers(model, [layer], screen=False) == []  # measured by the other: nothing here
    thread.join(30)
    assert tolerance.calibrate(model, layer).gap == 0.5


def test_a_build_still_running_after_the_notice_is_announced_while_it_runs(isolated_cache, caplog, monkeypatch):
    """A build still running ``paths.NOTICE`` seconds after it started is announced on ``lminvert.once`` before it
    ends (a first run's minutes of silence explained); a build that ends sooner is not."""
    from lminvert import paths

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    monkeypatch.setattr(paths, "NOTICE", 0.2)
    monkeypatch.setattr(paths, "SLOW", 3600.0)
    seen: list[list[str]] = []

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "lminvert.once"]

    def slow() -> torch.Tensor:
        time.sleep(0.6)
        seen.append(said())  # what was said while the build was still running
        return torch.ones(2)

    with caplog.at_level(logging.INFO, logger="lminvert.once"):
        cached(model, layer, "quick", lambda: torch.ones(2))
        time.sleep(0.4)
        assert said() == []  # ended before the notice: nothing said, and the timer was cancelled
        cached(model, layer, "slow", slow)
    assert len(seen[0]) == 1 and "building" in seen[0][0] and "layer1-slow" in seen[0][0], seen
    assert len(said()) == 1


def test_a_slow_one_time_build_is_reported_once_and_the_cli_shows_it(isolated_cache, caplog, monkeypatch):
    """A build of ``paths.SLOW`` seconds or more is reported on the ``lminvert.once`` logger (which the command-line
    tool shows without --verbose), once for the outer build only; a quick one is not."""
    from lminvert import paths
    from lminvert.cli import main

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    monkeypatch.setattr(paths, "SLOW", 0.05)
    with caplog.at_level(logging.INFO, logger="lminvert.once"):
        cached(model, layer, "quick", lambda: torch.ones(2))
        assert not [r for r in caplog.records if r.name == "lminvert.once"]

        def slow() -> torch.Tensor:
            time.sleep(0.1)
            return cached(model, layer, "inside", lambda: torch.ones(2)) + 1

        cached(model, layer, "slow", slow)
    said = [r.getMessage() for r in caplog.records if r.name == "lminvert.once"]
    assert len(said) == 1 and "layer1-slow" in said[0] and "kept in the cache" in said[0], said
    once = logging.getLogger("lminvert.once")
    before = once.level
    once.setLevel(logging.NOTSET)
    try:
        assert main(["models"]) == 0 and once.level == logging.INFO
    finally:
        once.setLevel(before)
