"""The injectivity lab at its smallest sizes: init (no collision at random initialisation), train (the loss falls,
a checkpoint resumes the run bit for bit, the trained model loads by path and inverts exactly) and break (the
constructions collide, their analytic contrasts do not, inversion flags what it cannot decide)."""

from __future__ import annotations

import json

import pytest

import lminvert
from lminvert import lab


def _search(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in doc["rows"]:
        if row.get("test") == "search":
            out.setdefault(row["construction"], []).append(row)
    return out


def _inverts(doc: dict, method: str = "sipit") -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in doc["rows"]:
        if row.get("test") == "invert" and row["method"] == method:
            out.setdefault(row["construction"], []).append(row)
    return out


def test_init_no_collision_at_random_initialisation(tmp_path):
    doc = lab.run("init", tmp_path, quick=True, seeds=2, prompts=120, progress=False)
    assert doc["kind"] == "lab" and (tmp_path / "results.md").exists()
    assert (tmp_path / "figures" / "init_minima.png").exists()
    assert {r["arch"] for r in doc["rows"]} == {"gpt2", "llama"}
    assert len({r["seed"] for r in doc["rows"]}) == 2
    for row in doc["rows"]:
        assert row["below_threshold"] == 0
        assert row["min_distance"] > 1e-4  # orders of magnitude above the 1e-6 threshold


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    sizes = {"steps": 16, "every": 8, "eval_prompts": 60}
    doc = lab.run("train", out, quick=True, progress=False, **sizes)
    return out, sizes, doc


def test_train_loss_decreases(trained):
    _, _, doc = trained
    curves = [r for r in doc["rows"] if not r.get("export")]
    for opt in ("sgd", "adam"):
        rows = [r for r in curves if r["opt"] == opt]
        start = next(r["eval_loss"] for r in rows if r["step"] == 0)
        end = next(r["eval_loss"] for r in rows if r["step"] == 16)
        assert end < start - (1.0 if opt == "adam" else 0.1), (opt, start, end)
        assert all(r["below_threshold"] == 0 for r in rows)  # still injective on the fixed prompts


def test_train_resumes_from_checkpoint(trained):
    out, sizes, doc = trained
    assert (out / "checkpoints" / "adam" / "step000008.pt").exists()
    # forget the second interval: the rerun must retrain it from the step-8 checkpoint, identically
    (out / "units" / "adam.steps000008-000016.json").unlink()
    again = lab.run("train", out, quick=True, progress=False, **sizes)
    assert again["units_resumed"] == len(again["units_seconds"]) - 1
    key = ("opt", "step", "layer", "train_loss", "eval_loss", "min_distance")
    before = [tuple(r.get(k) for k in key) for r in doc["rows"] if not r.get("export")]
    after = [tuple(r.get(k) for k in key) for r in again["rows"] if not r.get("export")]
    assert before == after


def test_trained_model_loads_by_path_and_inverts_exactly(trained):
    out, _, doc = trained
    exports = [r for r in doc["rows"] if r.get("export")]
    assert exports and all(r["exact"] and r["uncertain"] == 0 for r in exports)
    model = lminvert.load_model(str(out / "models" / "adam"))  # what --model DIR does
    ids = model.tokenize("def main():\n    return 0")
    result = lminvert.invert(model, lminvert.encode(model, [ids], 1))[0]
    assert result.token_ids == ids and not result.uncertain_positions


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    out = tmp_path_factory.mktemp("break")
    names = ["tied-rows", "hard-step", "act-4bit", "llama-analytic", "no-positions", "gpt2-analytic"]
    return lab.run("break", out, quick=True, progress=False, constructions=names, base_prompts=80, first_token_bases=10)


def test_break_constructions_collide_contrasts_do_not(broken):
    search = _search(broken)
    tied = search["tied-rows"]
    assert tied[0]["tied_groups"] and all(r["below_tied_inputs"] > 0 for r in tied)
    assert any(r["below_distinct_inputs"] > 0 for r in search["hard-step"])
    assert any(r["below_distinct_inputs"] > 0 for r in search["act-4bit"])
    assert all(r["below_distinct_inputs"] > 0 for r in search["no-positions"])
    for contrast in ("llama-analytic", "gpt2-analytic"):
        assert all(r["below_threshold"] == 0 and r["min_distance"] > 1e-6 for r in search[contrast])


def test_break_inversion_flags_tied_tokens_and_is_never_silently_wrong(broken):
    inverts = _inverts(broken)
    assert any(r["tied_flagged"] for r in inverts["tied-rows"])
    for name, rows in inverts.items():
        for row in rows:
            assert not row["wrong_unflagged"], (name, row)
            assert set(row["wrong"]) <= set(row["flagged"])


@pytest.fixture(scope="module")
def two_bit(tmp_path_factory):
    out = tmp_path_factory.mktemp("break2")
    # the quick size's own prompts: on them a position after a collision was once returned wrong and unflagged
    # (found given a wrong, flagged prefix); every position after a guess is now flagged too
    return lab.run(
        "break", out, quick=True, progress=False, constructions=["act-2bit"], bruteforce=["act-2bit"], invert_prompts=2
    )


def test_two_bit_activations_collide_and_bruteforce_flags_them(two_bit):
    assert all(r["below_distinct_inputs"] > 0 for r in _search(two_bit)["act-2bit"])
    rows = _inverts(two_bit, "bruteforce")["act-2bit"]
    assert rows and all(r["flagged"] and set(r["wrong"]) <= set(r["flagged"]) for r in rows)


def test_two_bit_sipit_never_silently_wrong(two_bit):
    # the hooked model is not known injective: sipit certifies every position (whole vocabulary) by itself
    rows = _inverts(two_bit, "sipit")["act-2bit"]
    assert rows and all(r["whole_vocabulary"] for r in rows)
    assert all(not r["wrong_unflagged"] for r in rows), json.dumps([r["wrong_unflagged"] for r in rows])


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["init"], "--out DIR is required")],
)
def test_cli_errors_are_one_line(cli, tmp_path, args, needle):
    proc = cli("lab", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("lminvert")]
    assert len(ours) == 1 and needle in ours[0]
