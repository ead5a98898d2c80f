"""The experiments on the shared runner: quick sizes on tiny models, resume, errors, the report pages."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import lminvert
from lminvert import experiments
from lminvert.errors import LminvertError
from lminvert.experiments.base import Context, Experiment, Summary, Table, Unit
from lminvert.experiments.runner import run_experiment
from lminvert.invert.hardprompts import hard_prompts
from lminvert.report import write_report
from lminvert.report.html import build_report

TINY = ("tiny-llama",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every inversion experiment's quick size on the tiny Llama, run once for the module."""
    root = tmp_path_factory.mktemp("experiments")
    out = {}
    for name in ("methods", "depth", "splits", "noise"):
        out[name] = root / name
        experiments.run(name, out[name], quick=True, models=TINY, progress=False)
    return out


def _doc(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


@pytest.mark.parametrize("name", ["methods", "depth", "splits", "noise"])
def test_quick_experiment_writes_results_markdown_and_figures(runs, name):
    doc = _doc(runs[name])
    assert doc["experiment"] == name and doc["config"]["quick"] and doc["rows"]
    assert doc["versions"]["torch"] == torch.__version__ and doc["machine"]["cpu_count"]
    markdown = (runs[name] / "results.md").read_text()
    assert "**The paper.**" in markdown and f"lminvert experiment {name} --quick --model tiny-llama" in markdown
    for spec in doc["summary"]["figures"]:
        png = runs[name] / "figures" / f"{spec['name']}.png"
        assert png.stat().st_size > 5000, png  # a drawn figure, not an empty canvas
        assert (runs[name] / "figures" / f"{spec['name']}.svg").exists()
        assert f"figures/{spec['name']}.png" in markdown


@pytest.mark.parametrize("name", ["depth", "splits", "noise"])
def test_quick_inversions_are_exact_or_flagged(runs, name):
    rows = _doc(runs[name])["rows"]
    assert all(r["wrong_unflagged"] == 0 for r in rows)
    noiseless = [r for r in rows if r.get("level", 0.0) == 0.0]
    assert noiseless and all(r["exact"] for r in noiseless)


def test_methods_table_has_every_method_and_the_papers_rows(runs):
    doc = _doc(runs["methods"])
    methods = {r["method"] for r in doc["rows"]}
    assert methods == {"sipit-linear", "sipit-secant", "bruteforce", "baseline", "hardprompts"}
    for r in doc["rows"]:
        if r["method"].startswith("sipit") or r["method"] == "bruteforce":
            assert r["exact"] and r["wrong_unflagged"] == 0
    brute = next(r for r in doc["rows"] if r["method"] == "bruteforce")
    assert brute["candidates_per_position"] == lminvert.load_model("tiny-llama").probe.vocab_size
    markdown = (runs["methods"] / "results.md").read_text()
    assert "6132.59 ± 104.61" in markdown and "28.01 ± 35.87" in markdown


def test_splits_cover_every_kind_and_chat_prompts_carry_the_template(runs):
    rows = _doc(runs["splits"])["rows"]
    assert {r["kind"] for r in rows} == {"prose", "code", "random", "chat"}
    model = lminvert.load_model("tiny-llama")
    from lminvert.experiments.prompts import evaluation_prompts

    (chat,) = evaluation_prompts(model, 1, 12, 0, kinds=("chat",))
    assert "<|im_start|>assistant" in model.decode(list(chat.ids)) and len(chat.ids) == 12


def test_noise_rows_carry_radius_and_noise_norm(runs):
    rows = [r for r in _doc(runs["noise"])["rows"] if r["level"] > 0]
    positions = [q for r in rows for q in r["positions"]]
    assert positions and all(q["noise_norm"] > 0 for q in positions)
    # a position decided from its only verified candidate (e.g. a chain's) has no measured gap: no radius, not inf
    radii = [q["certified_radius"] for q in positions if q["certified_radius"] is not None]
    assert radii and all(r > 0 for r in radii)


def test_resume_reads_finished_units_and_recomputes_only_missing_ones(runs, tmp_path):
    target = tmp_path / "splits"
    shutil.copytree(runs["splits"], target)
    before = _doc(target)
    units = sorted((target / "units").glob("*.json"))
    units[0].unlink()
    again = experiments.run("splits", target, quick=True, models=TINY, progress=False)
    assert again["units_resumed"] == len(units) - 1
    strip = lambda rows: [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]  # noqa: E731
    assert strip(again["rows"]) == strip(before["rows"])


def test_resume_refuses_a_different_run(runs, tmp_path):
    target = tmp_path / "noise"
    shutil.copytree(runs["noise"], target)
    with pytest.raises(LminvertError, match="different"):
        experiments.run("noise", target, quick=True, models=TINY, seed=1, progress=False)
    with pytest.raises(LminvertError, match="kind"):
        lminvert.find_collisions(lminvert.load_model("tiny-llama"), n_prompts=4, out=target, progress=False)


class _Interrupted(Exception):
    pass


class _Counting(Experiment):
    """Three units; the second raises on the first run, as if the process were interrupted there."""

    name = "counting"
    quick_size = full_size = {"n": 3}  # noqa: RUF012
    fail_at: int | None = 1
    calls: list[int] = []  # noqa: RUF012

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(f"u{i}", f"unit {i}", {"i": i}) for i in range(ctx.size["n"])]

    def run_unit(self, ctx: Context, unit: Unit) -> list[dict]:
        self.calls.append(unit.params["i"])
        if unit.params["i"] == self.fail_at:
            raise _Interrupted
        return [{"i": unit.params["i"], "square": unit.params["i"] ** 2}]

    def summarise(self, ctx: Context, rows) -> Summary:
        return Summary([Table("squares", ["i", "square"], [[r["i"], r["square"]] for r in rows])])


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    exp = _Counting()
    with pytest.raises(_Interrupted):
        run_experiment(exp, lambda name: None, tmp_path, models=(), progress=False)
    assert not (tmp_path / "results.json").exists() and (tmp_path / "units" / "u0.json").exists()
    exp.fail_at = None
    exp.calls.clear()
    doc = run_experiment(exp, lambda name: None, tmp_path, models=(), progress=False)
    assert exp.calls == [1, 2]  # unit 0 was read back, not recomputed
    assert [r["square"] for r in doc["rows"]] == [0, 1, 4]


def test_unknown_experiment_and_size_are_one_line_errors(tmp_path):
    with pytest.raises(LminvertError, match="unknown experiment 'nope'"):
        experiments.run("nope", tmp_path)
    with pytest.raises(LminvertError, match="has no size"):
        experiments.run("splits", tmp_path, quick=True, models=TINY, bogus=3)


def test_hardprompts_optimises_all_positions_jointly():
    model = lminvert.load_model("tiny-llama")
    ids = [5, 900, 31000, 77]
    states = lminvert.encode(model, [ids], 1).states[0]
    result = hard_prompts(model, states, 1, steps=30, seed=0)
    assert len(result.token_ids) == len(ids) and result.steps == 30
    assert 0 <= result.best_loss < 1.5  # the best projected point, relative squared error
    assert all(0 <= t < model.probe.vocab_size for t in result.token_ids)


def test_vocabulary_and_layers_quick_on_tiny_models(tmp_path):
    doc = experiments.run("vocabulary", tmp_path / "v", quick=True, models=TINY, progress=False, prompts=1, length=4)
    sizes = {r["vocab_size"] for r in doc["rows"]}
    assert {8192, 32768, 49152} <= sizes
    assert all(r["exact"] and r["wrong_unflagged"] == 0 for r in doc["rows"])
    doc = experiments.run(
        "layers", tmp_path / "l", quick=True, models=TINY, progress=False, n_prompts=60, exhaustive_prefixes=1
    )
    tests = {r["test"] for r in doc["rows"]}
    assert tests == {"collisions", "exhaustive"}
    assert all(r["min_distance"] > 1e-6 for r in doc["rows"] if r["test"] == "collisions")
    for spec in doc["summary"]["figures"]:
        if spec["kind"] == "file":
            assert (tmp_path / "l" / spec["path"]).exists()
    assert "0.001" in (tmp_path / "l" / "results.md").read_text()  # the paper's Llama-3.1-8B minimum at layer 1
    # on a markdown page the collision run's and the exhaustive run's figures (same file name) stay apart
    page = write_report([tmp_path / "l"], tmp_path / "page.md")
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())
    assert len(images) == len(set(images)) >= 3 and all((tmp_path / image).is_file() for image in images)


def _inversion_json(tmp_path: Path) -> Path:
    model = lminvert.load_model("tiny-llama")
    states = lminvert.encode(model, ["a secret: 4921"], 1)
    (r,) = lminvert.invert(model, states)
    doc = {**r.to_json(), "tokens": [model.decode([t]) for t in r.token_ids], "tolerances": [1e-3] * len(r.token_ids)}
    doc["uncertain_positions"] = [1]  # shown as uncertain in the page
    path = tmp_path / "inv.json"
    path.write_text(json.dumps([doc]))
    return path


def test_html_report_is_self_contained(runs, tmp_path):
    page = build_report([runs["splits"], runs["noise"], _inversion_json(tmp_path)])
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "http://" not in page and "https://" not in page
    assert page.count('src="data:image/png;base64,') >= 2
    assert 'class="tok unc"' in page and "secret" in page
    assert "Inversion under Gaussian noise" in page and "<table>" in page


def test_report_cli_errors_are_one_line(cli, tmp_path):
    args = ["report", str(tmp_path), "--out", str(tmp_path / "r.html")]
    proc = cli(*args)
    assert proc.returncode == 2 and "holds no results.json" in proc.stderr and "Traceback" not in proc.stderr
    args[-1] = str(tmp_path / "r.txt")
    proc = cli(*args)
    assert proc.returncode == 2 and "must end in .html" in proc.stderr


def test_experiment_cli_lists_and_refuses_bad_input(cli, tmp_path):
    def run(*args):
        return cli("experiment", *args)

    listed = run("--list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in experiments.EXPERIMENTS)
    for args, message in [
        (("nope", "--out", str(tmp_path / "x")), "unknown experiment"),
        (("splits",), "--out DIR is required"),
        (("splits", "--out", "/proc/forbidden"), "choose another --out"),
    ]:
        proc = run(*args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make chromium installs Debian's)")
def test_report_renders_in_a_real_browser(runs, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(build_report([runs["depth"], runs["noise"], _inversion_json(tmp_path)]))
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,4000",
         "--enable-logging=stderr", "--v=0", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    assert shot.exists(), proc.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    coloured = (pixels.max(axis=2) - pixels.min(axis=2)) > 0.25  # saturated pixels: plot lines, markers, tokens
    assert coloured.sum() > 2000, "no figure visible in the screenshot"


def test_markdown_page_replaces_only_its_block(runs, tmp_path):
    from lminvert.report import write_report

    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    write_report([runs["splits"]], page)
    generated = page.read_text()
    assert "## Inversion by kind of prompt" in generated and "(figures/splits/splits_candidates.png)" in generated
    assert (page.parent / "figures" / "splits" / "splits_candidates.png").exists()
    page.write_text("# Results\n\nhand-written benchmarks\n\n" + generated[generated.index("<!--") :] + "\ntail\n")
    write_report([runs["noise"]], page)
    text = page.read_text()
    assert text.startswith("# Results\n\nhand-written benchmarks") and text.rstrip().endswith("tail")
    assert "Gaussian noise" in text and "Inversion by kind of prompt" not in text


def test_experiment_cli_size_overrides_reach_the_run(cli, tmp_path):
    args = ["experiment", "splits", "--quick", "--model", "tiny-llama", "--out", str(tmp_path / "splits")]
    args += ["--size", "length=5", "--size", 'kinds=["random"]', "--json"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["config"]["size"]["length"] == 5 and {r["kind"] for r in doc["rows"]} == {"random"}
    assert all(r["length"] == 5 and r["exact"] for r in doc["rows"])
    bad = cli(*args[:-5], "--size", "nokey")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
    wrong_sizes = [
        ("length=abc", "--size length must be an int (the preset's is"),
        ("length=2.5", "--size length must be an int"),
        ('kinds="random"', "--size kinds must be a list"),
    ]
    for size, needle in wrong_sizes:
        wrong = cli(*args[:-5], "--size", size)  # length=abc was a TypeError from deep inside
        assert wrong.returncode == 2 and needle in wrong.stderr, wrong.stderr
        assert len(wrong.stderr.strip().splitlines()) == 1


def test_the_reproduce_line_names_a_precision_that_is_not_the_default():
    from lminvert.report.experiments import command_line

    doc = {
        "kind": "audit",
        "experiment": "audit",
        "config": {"quick": True, "models": ["smollm2-135m"]},
        "overrides": {},
    }
    assert (
        command_line({**doc, "dtype": "bfloat16"})
        == "lminvert audit --quick --model smollm2-135m --dtype bfloat16 --out DIR"
    )
    assert command_line({**doc, "dtype": "float32"}) == "lminvert audit --quick --model smollm2-135m --out DIR"
    experiment = {**doc, "kind": "experiment", "experiment": "noise", "dtype": "float16"}
    assert command_line(experiment).startswith("lminvert experiment noise --quick --model smollm2-135m --dtype float16")
