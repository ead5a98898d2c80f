"""One vector (``leak="last"``): whole prompts from a last position's state, every verdict the acceptor's, never a
wrong prompt claimed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lminvert
from lminvert.errors import LminvertError
from lminvert.invert import acceptor
from lminvert.invert.acceptor import Evidence, Radii
from lminvert.states import HiddenStates

from ..conftest import run_cli

CLAIMED = ("certified", "confident")
FAST = {"max_seconds": 20, "max_length": 3}  # tiny models: every length tried well within it
SHORT = {"max_seconds": 4, "max_length": 3}  # where nothing can be claimed: what is found within it is not asked


@pytest.fixture(scope="module")
def tiny():
    return lminvert.load_model("tiny-llama")


def _ids(model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.probe.vocab_size, (length,), generator=gen).tolist()


def _last(model, ids: list[int], layer) -> torch.Tensor:
    resolved = model.probe.layer(layer)
    return model.probe.states(torch.tensor(ids), [resolved])[resolved][0, -1].float()


def _claims_are_right(result, ids: list[int]) -> None:
    claimed = [v in CLAIMED for v in result.verdicts]
    assert all(claimed) or not any(claimed), result.verdicts  # one verdict for the whole prompt
    assert not any(claimed) or result.token_ids == ids, (result.token_ids, ids, result.verdicts)


def test_an_array_of_vectors_gives_back_short_prompts_certified_and_claims_nothing_wrong(tiny):
    """An ``[N, d]`` array is N vectors, each a prompt's last state (its own forward): the one- and two-token prompts
    come back certified (a forward of the candidate alone reproduces the vector bit for bit); longer ones are never
    claimed wrongly. The same row of a longer prompt's forward is not reproduced bit for bit (another shape rounds
    otherwise): uncertain, never wrong."""
    ids = _ids(tiny, 4, 3)
    vectors = torch.stack([_last(tiny, ids[: t + 1], 1) for t in range(len(ids))])
    results = lminvert.invert(tiny, HiddenStates.from_array(vectors), 1, leak="last", **FAST)
    assert len(results) == len(ids)
    for t, result in enumerate(results):
        _claims_are_right(result, ids[: t + 1])
    for t in (0, 1):
        assert results[t].token_ids == ids[: t + 1] and results[t].verdicts == ["certified"] * (t + 1)
        assert results[t].policy == "last" and any("whole prompts" in note for note in results[t].notes)
    rows = tiny.probe.states(torch.tensor(ids), [tiny.probe.layer(1)])[tiny.probe.layer(1)][0].float()
    for t, result in enumerate(lminvert.invert(tiny, rows[:2], 1, leak="last", **SHORT)):
        _claims_are_right(result, ids[: t + 1])


@pytest.mark.parametrize("layer", [2, "final"])
def test_a_two_token_prompt_comes_back_at_a_deeper_layer_and_normalised(tiny, layer):
    ids = _ids(tiny, 2, 11)
    vector = _last(tiny, ids, layer)
    for normalised in (False, True):
        given_vector = vector / vector.norm() if normalised else vector
        (result,) = lminvert.invert(tiny, given_vector, layer, leak="last", normalised=normalised, **FAST)
        assert result.token_ids == ids and result.verdicts == ["certified", "certified"], (normalised, result)


def test_a_prompt_longer_than_the_search_tries_is_uncertain_with_the_nearest_found(tiny):
    ids = _ids(tiny, 6, 5)
    (result,) = lminvert.invert(tiny, _last(tiny, ids, 1), 1, leak="last", **SHORT)
    assert 1 <= len(result.token_ids) <= SHORT["max_length"]
    assert set(result.verdicts) == {"uncertain"} and result.token_ids != ids


def test_vectors_of_no_prompt_of_this_model_are_never_claimed(tiny):
    """A vector of another layer, a perturbed one, a random one: uncertain, whatever is found."""
    ids = _ids(tiny, 2, 9)
    vector = _last(tiny, ids, 1)
    gen = torch.Generator().manual_seed(0)
    others = [
        _last(tiny, ids, 2),  # another layer's
        vector + 1e-3 * vector.norm() * torch.randn(vector.shape, generator=gen) / math.sqrt(vector.numel()),
        torch.randn(vector.shape, generator=gen) * vector.norm() / math.sqrt(vector.numel()),
    ]
    for other in others:
        (result,) = lminvert.invert(tiny, other, 1, leak="last", **SHORT)
        assert set(result.verdicts) == {"uncertain"}, result


def test_a_vector_of_another_model_of_the_same_shape_is_never_claimed(tiny):
    """A fine-tuned copy's vector (every weight moved by 1e-3 of its size) of a two-token prompt: this model's search
    tries that very prompt, which lies near but does not reproduce it: uncertain."""
    ids = _ids(tiny, 2, 13)
    other = lminvert.load_model("tiny-llama")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in other.model.parameters():
            weight.add_(1e-3 * weight.abs().mean() * torch.randn(weight.shape, generator=gen))
    (result,) = lminvert.invert(tiny, _last(other, ids, 1), 1, leak="last", **SHORT)
    assert set(result.verdicts) == {"uncertain"}, result


def test_bad_one_vector_input_is_a_one_line_error(tiny):
    vector = _last(tiny, _ids(tiny, 2, 1), 1)
    with pytest.raises(LminvertError, match="NaN"):
        lminvert.invert(tiny, torch.full_like(vector, math.nan), 1, leak="last")
    with pytest.raises(LminvertError, match="no direction"):
        lminvert.invert(tiny, torch.zeros_like(vector), 1, leak="last", normalised=True)
    with pytest.raises(LminvertError, match="--leak last"):
        lminvert.invert(tiny, vector[None], 1, normalised=True)
    with pytest.raises(LminvertError, match="--leak last"):
        lminvert.invert(tiny, vector[None], 1, max_length=4)
    with pytest.raises(LminvertError, match="at least 1"):
        lminvert.invert(tiny, vector, 1, leak="last", max_length=0)


def test_the_command_inverts_a_saved_vector_and_an_array_of_them(tiny, tmp_path):
    ids = _ids(tiny, 2, 21)
    vector = _last(tiny, ids, 1)
    np.save(tmp_path / "one.npy", vector.numpy())
    np.save(tmp_path / "two.npy", torch.stack([vector, vector / vector.norm()]).numpy())
    base = ["--model", "tiny-llama", "--leak", "last", "--layer", "1", "--max-seconds", "20", "--max-length", "2"]
    out = run_cli("invert", str(tmp_path / "one.npy"), *base, "--json")
    assert out.returncode == 0, out.stderr
    (doc,) = json.loads(out.stdout)
    assert doc["token_ids"] == ids and set(doc["verdicts"]) == {"certified"}
    out = run_cli("invert", str(tmp_path / "two.npy"), *base, "--normalised")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("2 certified") == 2  # the raw row's direction is compared too
    out = run_cli("invert", str(tmp_path / "one.npy"), "--model", "tiny-llama", "--layer", "1", "--normalised")
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "--leak last" in out.stderr


@settings(max_examples=300, deadline=None)
@given(
    dists=st.lists(st.floats(0, 10), min_size=1, max_size=12),
    plain=st.lists(st.one_of(st.none(), st.floats(0, 10)), min_size=12, max_size=12),
    radius=st.floats(0, 5),
    gap=st.one_of(st.just(0.0), st.floats(0, 4000)),
    reproducible=st.booleans(),
    exhausted=st.booleans(),
)
def test_whole_prompts_are_certified_only_where_reproduced_and_confident_only_within_half_the_gap(
    dists, plain, radius, gap, reproducible, exhausted
):
    """The acceptor on whole prompts (``Evidence.whole``): whatever the distances, radii, gap and source, ``certified``
    only for a candidate whose forward alone reproduced the vector, ``confident`` only for one whose re-measured
    distance lies within the error bound with twice it and the bound ``GAP_SAFETY`` times under the gap, no other
    candidate within the bound."""
    n, resolution = len(dists), 1e-6
    target = torch.zeros(4)
    states = torch.randn(n, 4)
    measured = {i: d for i, d in enumerate(plain[:n]) if d is not None}
    evidence = Evidence(
        torch.arange(n), torch.tensor(dists, dtype=torch.float64), states, target, measured, radius, reproducible,
        exhausted=exhausted, checked=n, whole=True,
    )  # fmt: skip
    radii = Radii(radius, radius, 0.0, radius / 2, gap, resolution)
    decision = acceptor.decide(evidence, radii)
    if decision.verdict == acceptor.CERTIFIED:
        assert measured.get(decision.token, math.inf) <= resolution
    if decision.verdict == acceptor.CONFIDENT:
        distance = measured[decision.token]
        assert distance <= radius and 2 * (distance + radius) * acceptor.GAP_SAFETY < gap
        others = [d for i, d in measured.items() if i != decision.token]
        assert all(d > radius for d in others) or not others


def test_a_whole_prompt_within_the_bound_is_confident_only_where_the_gap_rules_out_every_other():
    """The rule the property above bounds, on one case each way: the nearest prompt fits, another verified one lies
    far; confident with the gap wide enough, uncertain with it too narrow or with another prompt inside the bound."""
    target, states = torch.zeros(4), torch.randn(2, 4)

    def verdict(plain: dict[int, float], gap: float) -> str | None:
        evidence = Evidence(
            torch.arange(2), torch.tensor([plain[0], plain[1]], dtype=torch.float64), states, target, plain,
            0.1, False, exhausted=True, checked=2, whole=True,
        )  # fmt: skip
        return acceptor.decide(evidence, Radii(0.1, 0.1, 0.09, 0.01, gap, 1e-6)).verdict

    assert verdict({0: 0.01, 1: 5.0}, 100.0) == acceptor.CONFIDENT  # 2 x (0.01 + 0.1) x 64 = 14.1 < 100
    assert verdict({0: 0.01, 1: 5.0}, 10.0) == acceptor.UNCERTAIN
    assert verdict({0: 0.001, 1: 0.05}, 100.0) == acceptor.UNCERTAIN  # separated from it, but inside the bound


def test_the_whole_prompt_gap_is_measured_once_and_lies_below_the_nearest_pair_it_saw(isolated_cache, monkeypatch):
    """:mod:`lminvert.invert.wholegap`: the smallest relative gap between two prompts' last states the calibration saw
    (and between unit vectors), positive, measured once and kept, and no wider than a pair of prompts it compared."""
    from lminvert.invert import wholegap
    from lminvert.invert.tolerance import calibration_prompts

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    raw, unit = wholegap.whole_gap(model, layer), wholegap.whole_gap(model, layer, normalised=True)
    assert 0 < raw < math.inf and 0 < unit <= 2
    base = calibration_prompts(model)[0][:2]
    here, shorter = _last(model, base, 1).double(), _last(model, base[1:], 1).double()
    assert raw <= float((here - shorter).norm() / here.norm())  # the prompt without its first token: one it saw
    monkeypatch.setattr(wholegap, "_measure", None)  # a second measurement would fail
    assert wholegap.whole_gap(lminvert.load_model("tiny-llama"), layer) == raw  # read back from the cache
