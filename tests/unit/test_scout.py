"""The scout (:mod:`lminvert.invert.scout`): a whole-prompt guess from a search in bfloat16 GEMMs, checked by one plain
forward. It changes speed, never the answer: right, wrong or cut short, the tokens and verdicts are those of the
search without it."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

import lminvert
from lminvert.forward import encode
from lminvert.invert import invert, scout
from lminvert.invert.acceptor import TOKEN_GAP_SAFETY, Radii
from lminvert.invert.engine import InvertConfig, invert_prompts
from lminvert.invert.scout import MAX_ERROR, pays, scouting_calibration
from lminvert.invert.tolerance import SAFETY, scout_error, screen_calibration

from ..conftest import TINY

IDS = [17, 4021, 3300, 17, 5, 912, 64, 64, 7, 30000, 12, 9]
engine = importlib.import_module("lminvert.invert.engine")


def _verdicts(result) -> list[str]:
    return [p.verdict for p in result.positions]


@pytest.mark.parametrize("family", TINY)
def test_a_right_guess_decides_every_position_without_a_forward_of_its_own(family):
    """The scout finds the prompt, and the search after it decides every position from the guess's plain forward,
    verifying nothing else: the same tokens and verdicts as without it."""
    model = lminvert.load_model(family)
    states = encode(model, [IDS], 2)
    (on,) = invert(model, states, scout=True)
    (off,) = invert(model, states, scout=False)
    assert on.token_ids == off.token_ids == IDS
    assert _verdicts(on) == _verdicts(off)
    assert on.uncertain_positions == []
    assert all(p.speculated for p in on.positions)
    # after the scout, each position verified its guess alone (its plain state); the scout's own work is counted there
    assert all(p.scouted >= 1 and p.candidates_checked == p.scouted + 1 for p in on.positions)
    assert not any(p.scouted for p in off.positions)
    # the candidates the scout rejected give the margins (the nearest rejected one), as a search's own would
    assert any(math.isfinite(p.margin) for p in on.positions)
    assert all(p.margin > p.distance for p in on.positions)


@pytest.mark.parametrize("guess", ["wrong at 5", "wrong at 0", "cut at 4", "empty"])
def test_a_wrong_or_short_guess_changes_nothing_but_the_time(monkeypatch, guess):
    """From the first position the guess gets wrong (or where it ends) the search goes on as without the scout."""
    model = lminvert.load_model("tiny-llama")
    states = encode(model, [IDS], 2)
    (off,) = invert(model, states, scout=False)

    def guessed(*args, **kwargs):
        if guess == "empty":
            tokens = []
        elif guess == "cut at 4":
            tokens = IDS[:4]
        else:
            at = int(guess.split()[-1])
            tokens = [*IDS[:at], (IDS[at] + 1) % 1000, *IDS[at + 1 :]]
        positions = [SimpleNamespace(candidates_checked=1, forwards=0, token_id=t, margin=math.inf) for t in tokens]
        return [SimpleNamespace(token_ids=tokens, positions=positions)]

    monkeypatch.setattr(engine, "_scout", guessed)
    (on,) = invert(model, states, scout=True)
    assert on.token_ids == off.token_ids == IDS
    assert _verdicts(on) == _verdicts(off)
    decided = {"wrong at 5": 5, "wrong at 0": 0, "cut at 4": 4, "empty": 0}[guess]
    assert all(p.speculated for p in on.positions[:decided])
    assert sum(p.forwards for p in on.positions[decided:]) >= 1


def test_foreign_states_keep_their_verdicts_with_the_scout():
    """States from a padded batch (``source="float"``): the guess's plain forward is not theirs bit for bit, and every
    position keeps the verdict the search without the scout gives."""
    model = lminvert.load_model("tiny-llama")
    probe = model.probe
    batch = torch.tensor([IDS, [5] * len(IDS)])
    rows = probe.states(batch, [2])[probe.layer(2)][0]
    (on,) = invert(model, rows, 2, source="float", scout=True)
    (off,) = invert(model, rows, 2, source="float", scout=False)
    assert on.token_ids == off.token_ids == IDS
    assert _verdicts(on) == _verdicts(off)


def test_the_scouts_search_stops_a_prompt_at_a_position_that_fits_nothing():
    """In the scout's search a position that fits no candidate ends the prompt there (the guess is cut), where the
    search itself would go on to the end."""
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    states = encode(model, [IDS], layer).states[0].clone()
    states[6] = states[6] * 3.0  # no token's state lies there
    config = InvertConfig(scout=False, screen=False, max_candidates=64)
    calibration = scouting_calibration(model, layer)
    (scouted,) = invert_prompts(model, [states], layer, config, calibration=calibration, scouting=True)
    assert scouted.token_ids[:6] == IDS[:6] and len(scouted.token_ids) == 7
    (full,) = invert_prompts(model, [states], layer, config)
    assert len(full.token_ids) == len(IDS)


def test_where_the_scout_goes():
    """By default where bfloat16 GEMMs are native, from 30% of the depth on, where a state computed with them is at
    most ``MAX_ERROR`` off and without a budget of candidates per position; never without chains, for a brute force
    or on a model whose linear layers cannot run in bfloat16; ``scout=True`` sends it wherever it can run."""
    model = lminvert.load_model("tiny-llama")
    probe = model.probe
    wants = engine._scouts
    small = scout.error(model, probe.layer(2)) <= MAX_ERROR
    assert pays(model, probe.layer(2)) == (probe.can_screen and small)
    assert not pays(model, probe.layer(0))
    assert wants(model, probe.layer(0), InvertConfig(scout=True), True)
    assert not wants(model, probe.layer(2), InvertConfig(scout=True, speculate=False), True)
    assert not wants(model, probe.layer(2), InvertConfig(scout=True, method="bruteforce"), True)
    assert not wants(model, probe.layer(2), InvertConfig(scout=True), False)
    assert not wants(model, probe.layer(2), InvertConfig(scout=False), True)
    assert wants(model, probe.layer(2), InvertConfig(), True) == (probe.can_screen and small)
    assert not wants(model, probe.layer(2), InvertConfig(max_candidates=64), True)  # its candidates would come on top
    assert wants(model, probe.layer(2), InvertConfig(scout=True, max_candidates=64), True)
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    assert not wants(half, half.probe.layer(2), InvertConfig(scout=True), True)


def test_a_scout_asked_of_a_model_that_cannot_run_it_is_a_one_line_error(cli, tmp):
    """``scout=True`` (``--scout``) on a model whose linear layers cannot run in bfloat16 (a bfloat16 model) is
    refused in one line naming the option, before any search; ``--no-scout`` there is no error."""
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    states = encode(half, [IDS[:4]], 2)
    with pytest.raises(lminvert.LminvertError, match="drop --scout"):
        invert(half, states, scout=True)
    (result,) = invert(half, states, scout=False)
    assert result.token_ids == IDS[:4]
    path = tmp / "s.safetensors"
    states.save(path)
    proc = cli("invert", str(path), "--model", "tiny-llama", "--dtype", "bfloat16", "--scout")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "--scout" in proc.stderr


def test_the_scout_reads_the_screened_disagreements_typical_quantile(monkeypatch):
    """The scout's ball and its rule read the 90th percentile of the screened states' disagreements, kept beside their
    maximum (which screening reads); with ``scout.TYPICAL`` off, the maximum."""
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    typical, worst = scout_error(model, layer), screen_calibration(model, layer)
    assert 0.0 < typical <= worst
    assert scout.error(model, layer) == typical
    assert scouting_calibration(model, layer).cached == typical
    # the tokens' distance apart the acceptor counts on (Radii.apart) is twice the scout's ball: decisive, no reach
    assert scouting_calibration(model, layer).gap / TOKEN_GAP_SAFETY == pytest.approx(2.0 * SAFETY * typical)
    scouting, target = scouting_calibration(model, layer, scale=1.5), torch.ones(16)
    ball = scouting.radius(target)
    radii = Radii(ball, ball, 0.0, ball, scouting.gap * float(target.norm()), 1e-7)  # the gap's scale, as search.py
    assert radii.decisive and radii.apart / 2 == pytest.approx(ball)
    monkeypatch.setattr(scout, "TYPICAL", False)
    assert scout.error(model, layer) == worst
    assert scouting_calibration(model, layer).cached == worst
