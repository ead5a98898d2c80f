"""States lminvert did not compute: padded transformers batches, a fine-tuned copy's states, noise, --source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import lminvert
from lminvert.forward import padded_batch, padded_positions
from lminvert.invert import acceptor, invert
from lminvert.states import HiddenStates

from ..conftest import run_cli

LAYER = 1  # tiny-llama has 2 blocks: transformers' index 2 is after the final norm


def padded_capture(model, prompts: list[list[int]], layer: int, side: str) -> list[torch.Tensor]:
    """What a deployment saves: transformers' ``output_hidden_states`` of one padded batch (index ``layer`` = the
    output of block ``layer``), the real tokens' rows of each prompt."""
    ids, mask = padded_batch(prompts, range(len(prompts)), side)
    assert mask is not None  # the prompts' lengths differ: the batch pads
    positions = padded_positions(ids, mask)  # counted from each row's first token, as generate() does
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    return [out.hidden_states[layer][i][mask[i].bool()].clone() for i in range(len(prompts))]


def prompts_of(model, n: int = 4, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.probe.vocab_size, (7 - i % 3,), generator=gen).tolist() for i in range(n)]


def check(results, prompts) -> dict[str, int]:
    """Every token right and nothing wrong stated better than uncertain; the verdict counts."""
    counts = dict.fromkeys(acceptor.VERDICTS, 0)
    for r, truth in zip(results, prompts, strict=True):
        for p, token, verdict in zip(r.positions, truth, r.verdicts, strict=True):
            assert p.token_id == token or verdict == acceptor.UNCERTAIN
            counts[verdict] += 1
        assert r.token_ids == truth
    return counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_transformers_batch_inverts_with_verdicts(dtype, side):
    model = lminvert.load_model("tiny-llama", dtype=dtype)
    prompts = prompts_of(model)
    states = HiddenStates.from_array(padded_capture(model, prompts, LAYER, side))
    results = invert(model, states, LAYER)  # a bare array: the float source by default
    assert {r.source for r in results} == {"float"}
    counts = check(results, prompts)
    total = sum(counts.values())
    assert counts["certified"] + counts["confident"] >= 0.95 * total, counts


def test_own_states_stay_certified():
    model = lminvert.load_model("tiny-llama")
    prompts = prompts_of(model, seed=1)
    results = invert(model, lminvert.encode(model, prompts, LAYER))
    assert all(r.source == "exact" and set(r.verdicts) == {"certified"} for r in results)
    assert [r.token_ids for r in results] == prompts


def test_a_fine_tuned_copys_states_are_never_wrong_and_sure():
    """States of a copy whose block weights moved by 1e-3 of their spread (a light fine-tune): the search ends within
    its bound, and no wrong token is certified or confident."""
    model = lminvert.load_model("tiny-llama")
    tuned = lminvert.load_model("tiny-llama")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, w in tuned.model.named_parameters():
            if ".layers." in name:
                w += 1e-3 * w.std() * torch.randn(w.shape, generator=gen)
    prompts = prompts_of(model, n=2, seed=2)
    leak = HiddenStates.from_array([s[0] for s in _own(tuned, prompts)])
    results = invert(model, leak, LAYER, source="float")
    for r, truth in zip(results, prompts, strict=True):
        for p, token in zip(r.positions, truth, strict=True):
            assert p.token_id == token or p.verdict == acceptor.UNCERTAIN
            assert p.candidates_checked <= model.probe.vocab_size


def _own(model, prompts):
    return [model.probe.states(torch.tensor([p]), [LAYER])[model.probe.layer(LAYER)] for p in prompts]


def test_noise_far_above_the_gaps_is_uncertain_never_wrong_and_sure():
    model = lminvert.load_model("tiny-llama")
    prompts = prompts_of(model, n=1, seed=3)
    results = invert(model, lminvert.encode(model, prompts, LAYER), noise=2.0, max_candidates=512)
    for r, truth in zip(results, prompts, strict=True):
        assert r.source == "noise:2"
        for p, token in zip(r.positions, truth, strict=True):
            assert p.token_id == token or p.verdict == acceptor.UNCERTAIN
        assert acceptor.UNCERTAIN in r.verdicts


def test_states_of_another_layer_end_with_a_note():
    model = lminvert.load_model("tiny-llama")
    prompts = prompts_of(model, n=1, seed=4)
    other = lminvert.encode(model, prompts, LAYER + 1)
    (result,) = invert(model, HiddenStates.from_array(other.states), LAYER)
    assert result.notes and "do not match" in result.notes[0]
    assert all(
        p.verdict == acceptor.UNCERTAIN or p.token_id == t for p, t in zip(result.positions, prompts[0], strict=True)
    )
    assert max(result.candidates_checked) <= acceptor.GIVE_UP + 1024  # bounded, not the vocabulary


def test_cli_source(tmp_path):
    model = lminvert.load_model("tiny-llama", dtype="bfloat16")
    prompts = prompts_of(model, n=2, seed=6)
    path = tmp_path / "leak.npy"
    np.save(path, torch.stack([s[:6] for s in padded_capture(model, prompts, LAYER, "right")]).float().numpy())
    proc = run_cli("invert", str(path), "--model", "tiny-llama", "--dtype", "bfloat16", "--layer", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert [d["token_ids"] for d in docs] == [p[:6] for p in prompts]
    assert all(d["source"] == "float" and len(d["verdicts"]) == 6 for d in docs)
    text = run_cli("invert", str(path), "--model", "tiny-llama", "--dtype", "bfloat16", "--layer", "1")
    assert "verdicts (float source)" in text.stdout
    for bad, says in ((["--source", "gauss:1"], "unknown source"), (["--source", "float", "--noise", "0.1"], "either")):
        proc = run_cli("invert", str(path), "--model", "tiny-llama", "--layer", "1", *bad)
        assert proc.returncode != 0 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize(
    ("construction", "source"),
    [("tied-rows", "exact"), ("tied-rows", "float"), ("tied-rows", "noise:0.01"), ("act-2bit", "float")],
)
def test_constructed_non_injective_models_are_never_wrong_and_sure(construction, source):
    """The lab's constructions that break injectivity (a tied embedding row; block outputs quantised to 2 bits, whose
    exact source tests/unit/test_lab.py covers): under the error models, a wrong token is never certified or confident
    (a hooked model is certified against the whole vocabulary: short prompts)."""
    from lminvert.lab.constructions import quantise_activations, tie_rows

    model = lminvert.load_model("tiny-llama")
    net = model.model
    prompts = [[9, 40, 9, 7], prompts_of(model, n=1, seed=7)[0][:4]]
    if construction == "act-2bit":
        prompts = [prompts[1][:3]]
    if construction == "tied-rows":
        tie_rows(net, 5, 9)
    else:
        every = model.probe.states(torch.tensor(prompts), model.probe.layers([1, 2]))
        quantise_activations(net, 2, [float(h.abs().max()) for h in every.values()])
    broken = lminvert.LoadedModel.wrap(construction, net, model.tokenizer)
    results = invert(broken, lminvert.encode(broken, prompts, LAYER), source=source)
    for r, truth in zip(results, prompts, strict=True):
        wrong = [t for t, (a, b) in enumerate(zip(r.token_ids, truth, strict=True)) if a != b]
        assert set(wrong) <= set(r.uncertain_positions), (construction, source, r.verdicts, wrong)
    if construction == "tied-rows":
        assert 0 in results[0].uncertain_positions  # token 9's twin cannot be told apart


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sink_bands_cover_every_eager_state_they_were_measured_on(dtype):
    """:func:`lminvert.invert.layouts.sink_bands`: the bands never decrease with the norm, and the bound they give
    holds every sink-like eager-attention state of the random prompts they were measured on without its safety factor
    (by the state's own norm); :func:`foreign_calibration` turns them into absolute norms of that layer."""
    from lminvert.invert import Float
    from lminvert.invert.engine import bound_source
    from lminvert.invert.layouts import SINK_BANDS, SINK_PROMPTS, SINK_SEED, foreign_calibration, sink_bands
    from lminvert.invert.tolerance import SAFETY
    from lminvert.models.observed import attention

    model = lminvert.load_model("tiny-llama", dtype=dtype)
    layer = model.probe.layer(LAYER)
    measured = sink_bands(model, layer)
    typical, rels = float(measured[0]), measured[1:]
    assert typical > 0 and len(rels) == len(SINK_BANDS)
    assert torch.equal(rels, torch.cummax(rels, dim=0).values)
    ids = torch.randint(0, model.probe.vocab_size, SINK_PROMPTS, generator=torch.Generator().manual_seed(SINK_SEED))
    plain = model.probe.states(ids, [layer])[layer].float()
    with attention(model.probe, "eager"):
        eager = model.probe.states(ids, [layer])[layer].float()
    calibrated = foreign_calibration(model, layer)
    source = bound_source(model, layer, Float())
    rows, got = plain[:, 1:].flatten(0, 1).double(), eager[:, 1:].flatten(0, 1).double()
    sinklike = got.norm(dim=1) >= SINK_BANDS[0] * typical
    assert int(sinklike.sum()) > 0  # the bands saw something
    for h, g in zip(rows[sinklike], got[sinklike], strict=True):
        assert float((g - h).norm()) <= source.bound(g.float(), 1) / SAFETY + 1e-9
    edges = [size / typical for size, _ in calibrated.bands]
    assert all(any(abs(e - edge) < 1e-6 for edge in SINK_BANDS) for e in edges)


def test_a_rows_search_asks_the_acceptor_again_where_the_chosen_tokens_state_is_sink_like(monkeypatch):
    """The rows search (a leak searched in its rows' space: here int8-quantised states) tells the acceptor where a
    confident token's own state is sink-like (:mod:`lminvert.invert.rows.sinklike`), and the acceptor makes it a
    guess where the ball is not decisive; a state that is not sink-like keeps its verdict."""
    from lminvert.invert.rows import sinklike
    from lminvert.invert.sources import parse_source

    model = lminvert.load_model("tiny-llama")
    ids = torch.randint(0, model.probe.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).tolist()
    source = parse_source("quant:int8")
    own = lminvert.encode(model, ids, LAYER).states
    rows = torch.stack([source.simulate(s.float(), torch.Generator().manual_seed(0)) for s in own])
    plain = invert(model, HiddenStates.from_array(rows), LAYER, source="quant:int8")
    assert [r.token_ids for r in plain] == ids
    assert all(v == acceptor.CONFIDENT for r in plain for v in r.verdicts[1:])
    monkeypatch.setattr(sinklike.SinkLike, "fragile", lambda self, prefix, token, memo=None: bool(prefix))
    told = invert(model, HiddenStates.from_array(rows), LAYER, source="quant:int8")
    # position 1 a guess by its own row, so the next row chose it (uncertain here too)
    assert all(p.reason == acceptor.BY_NEXT for r in told for p in r.positions[1:2])
    assert all(p.reason == acceptor.FRAGILE for r in told for p in r.positions[2:])
    assert all(v == acceptor.UNCERTAIN for r in told for v in r.verdicts[1:])
    assert [r.token_ids for r in told] == ids


def test_a_state_is_sink_like_by_its_norm_against_the_bands_never_at_position_0(monkeypatch):
    from lminvert.invert import Float
    from lminvert.invert.rows import sinklike
    from lminvert.invert.rows.memo import StateMemo

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(LAYER)
    norm = float(model.probe.states(torch.tensor([[3, 5]]), [layer])[layer][0, 1].float().norm())
    for top, expected in ((norm / 2, True), (norm * 2, False)):
        source = Float().calibrated(0.0, 1e-3, ((top, 0.5),))
        monkeypatch.setattr(sinklike, "bound_source", lambda model, layer, float_, source=source: source)
        check = sinklike.SinkLike(model, layer)
        assert check.fragile([3], 5) is expected
        assert check.fragile([3], 5, StateMemo(model, layer)) is expected  # the state kept by the search, or run
        assert check.fragile([], 5) is False


def test_a_model_that_runs_eager_attention_measures_its_sink_bands_against_sdpa():
    from lminvert.invert.layouts import sink_bands
    from lminvert.models.observed import attention

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(LAYER)
    with attention(model.probe, "eager"):
        measured = sink_bands(model, layer)
    assert float(measured[0]) > 0 and float(measured[1:].max()) > 0  # SDPA's states differ from eager's somewhere
