"""Screening: a float32 model's large candidate batches first run with bfloat16 GEMMs and only the candidates near the
target are verified in float32; the rest are verified before a position would be given up. Speed only, never the
answer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import lminvert
from lminvert.forward import encode
from lminvert.invert import invert, search, verification
from lminvert.invert.tolerance import calibrate, screen_calibration
from lminvert.models.halfmath import LinearMath


def test_linear_math_runs_a_float32_models_linear_layers_as_bfloat16_gemms():
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 128)
    x = torch.randn(64, 96, generator=gen)
    with torch.no_grad():
        exact = linear(x)
        with LinearMath(linear, torch.float32, torch.bfloat16):
            fast = linear(x)
        after = linear(x)
        reference = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
    assert fast.dtype == torch.float32 and torch.equal(fast, reference)
    assert not torch.equal(fast, exact) and torch.equal(after, exact)  # bfloat16 inside only
    torch.testing.assert_close(fast, exact, rtol=0.05, atol=0.05)


class Spy:
    """Counts screened batches, the candidates verified in full from them and the positions that fell back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches = self.picked = self.fallbacks = 0
        screened, propose = search.PromptSearch.screened, search.PromptSearch.propose
        spy = self

        def counted_screened(self, ids, states, picks, verified, keys_of):
            spy.batches += 1
            spy.picked += len(picks)
            return screened(self, ids, states, picks, verified, keys_of)

        def counted_propose(self):
            before = self.unscreening
            ids = propose(self)
            spy.fallbacks += self.unscreening and not before
            return ids

        monkeypatch.setattr(search.PromptSearch, "screened", counted_screened)
        monkeypatch.setattr(search.PromptSearch, "propose", counted_propose)


@pytest.mark.parametrize("recheck", [search.RECHECK, 0])
def test_screening_changes_speed_never_the_answer(monkeypatch, recheck):
    """Every later batch screened (the secant policy verifies all its batches one-token, no chains): the same ids
    without a flag as without screening; with no candidate ever picked from a screened batch every position after the
    first batch is found by verifying the screened-out in full before giving up (within the same budget)."""
    model = lminvert.load_model("tiny-llama")
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.probe.vocab_size, (6,), generator=gen).tolist(), [17, 4021, 3300, 17, 5]]
    states = encode(model, ids, 2)
    plain = invert(model, states, policy="secant", screen=False, max_candidates=2000)
    monkeypatch.setattr(verification, "SCREEN_FROM", 1)
    monkeypatch.setattr(search, "RECHECK", recheck)
    spy = Spy(monkeypatch)
    screened = invert(model, states, policy="secant", screen=True, max_candidates=2000)
    assert [r.token_ids for r in plain] == [r.token_ids for r in screened] == ids
    assert all(r.uncertain_positions == [] for r in plain + screened)
    assert spy.batches > 0
    if recheck:
        assert spy.picked > 0 and spy.fallbacks == 0  # the token was among the picks every time
    else:
        assert spy.picked == 0 and spy.fallbacks > 0
    out = [p.screened_out for r in screened for p in r.positions]
    assert sum(out) > 0 if recheck else sum(out) == 0  # without picks every screened-out is verified in the end
    forwarded = [p.candidates_checked for r in screened for p in r.positions]
    assert all(0 <= o < f for o, f in zip(out, forwarded, strict=True))


def test_screening_radius_is_measured_and_wider_than_float32s(isolated_cache):
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    screen = screen_calibration(model, layer)
    cached = calibrate(model, layer).cached
    assert 100 * cached < screen < 0.2  # bfloat16's rounding, far above float32's, far below the state's norm
    assert screen_calibration(model, layer) == screen  # cached


def test_screening_a_half_model_is_refused():
    model = lminvert.load_model("tiny-llama", dtype="bfloat16")
    states = encode(model, [[5, 6, 7]], 1)
    with pytest.raises(lminvert.LminvertError, match="float32"):
        invert(model, states, screen=True)
    with pytest.raises(ValueError, match="float32"), model.probe.screening():
        pass


def test_cli_screens_on_request_and_refuses_screening_half_states(cli, tmp):
    path = tmp / "s.safetensors"
    cli("encode", "--model", "tiny-llama", "--layer", "2", "--text", "Secret: 1234", "--out", str(path),
        "--keep-ids", check=True)  # fmt: skip
    truth = list(lminvert.HiddenStates.load(path).token_ids[0])
    for flag in ("--screen", "--no-screen"):
        (doc,) = json.loads(cli("invert", str(path), "--json", flag, check=True).stdout)
        assert doc["token_ids"] == truth and doc["uncertain_positions"] == []
        assert len(doc["screened_out"]) == len(truth)
        assert flag == "--screen" or doc["screened_out"] == [0] * len(truth)
    half = tmp / "h.safetensors"
    cli("encode", "--model", "tiny-llama", "--dtype", "bfloat16", "--layer", "2", "--text", "Secret: 1234",
        "--out", str(half), check=True)  # fmt: skip
    proc = cli("invert", str(half), "--screen")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "float32" in proc.stderr and "drop --screen" in proc.stderr
