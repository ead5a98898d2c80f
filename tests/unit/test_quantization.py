"""Weight quantisation with bitsandbytes: a real change of weights, the probe still exact, the quick experiment."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import lminvert
from lminvert import experiments
from lminvert.errors import LminvertError
from lminvert.invert.tolerance import calibrate
from lminvert.models.quantize import SCHEMES, quantize, quantized_layers

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def base():
    return lminvert.load_model("tiny-llama")


@pytest.fixture(scope="module")
def quantised(base):
    return {scheme: quantize(base, scheme) for scheme in SCHEMES}


def _ids(model, batch=2, length=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.probe.vocab_size, (batch, length), generator=gen)


def _linears(model) -> int:
    head = model.model.get_output_embeddings()
    return sum(1 for m in model.model.modules() if isinstance(m, nn.Linear) and m is not head)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_replaces_every_linear_and_changes_the_states(base, quantised, scheme):
    q = quantised[scheme]
    assert quantized_layers(q) == _linears(base) > 0 and quantized_layers(base) == 0
    assert q.name == f"tiny-llama+{scheme}" and q.dtype == "float32"
    ids = _ids(base)
    ref = base.probe.states(ids, "all")
    ours = q.probe.states(ids, "all")
    for layer, state in ours.items():
        rel = float((state - ref[layer]).norm() / ref[layer].norm())
        assert 1e-4 < rel < 0.5, (scheme, layer, rel)  # quantised (not a no-op), still the same model


def test_the_base_model_is_left_alone_and_hashes_identify_each_scheme(base, quantised):
    fresh = lminvert.load_model("tiny-llama")
    assert base.weights_hash == fresh.weights_hash and quantized_layers(base) == 0
    ids = _ids(base)
    torch.testing.assert_close(base.probe.states(ids, 2)[2], fresh.probe.states(ids, 2)[2], rtol=0, atol=0)
    hashes = {q.weights_hash for q in quantised.values()}
    assert len(hashes) == len(SCHEMES) and base.weights_hash not in hashes
    assert quantize(base, "nf4").weights_hash == quantised["nf4"].weights_hash  # deterministic: tables stay cached


@pytest.mark.parametrize("scheme", SCHEMES)
def test_probe_parity_on_the_quantised_model(base, quantised, scheme):
    q = quantised[scheme]
    probe = q.probe
    ids = _ids(q)
    with torch.no_grad():
        ref = q.model(input_ids=ids, output_hidden_states=True).hidden_states
    ours = probe.states(ids, [*range(probe.n_layers + 1), "final"])
    for layer in range(probe.n_layers):
        torch.testing.assert_close(ours[layer], ref[layer], rtol=0, atol=0)
    torch.testing.assert_close(ours[probe.final], ref[-1], rtol=0, atol=0)
    # embeddings are not quantised: the input vectors are the float model's
    torch.testing.assert_close(probe.vocab_matrix(), base.probe.vocab_matrix(), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cached_batched_continuation_reproduces_the_full_forward(quantised, scheme):
    """What exact inversion needs: the engine's verification forward agrees with encode() within the tolerance."""
    q = quantised[scheme]
    ids = _ids(q, batch=1, length=6)[0].tolist()
    layer = q.probe.layer(1)
    full = q.probe.states(torch.tensor([ids]), [layer])[layer][0]
    prefix = q.probe.prefix(ids[:4], layer)
    batch = torch.tensor([ids[4], *range(31)])
    state = q.probe.continuation(prefix, token_ids=batch)[0]
    assert float((state - full[4]).norm()) < calibrate(q, layer).radius(full[4])  # the radius measured on q


def test_llm_int8_outlier_columns_make_a_state_depend_on_the_batch(quantised):
    """int8 (threshold 6) keeps input columns with an outlier anywhere in the batch in float16; int8-t0 does not."""
    q8, q0 = quantised["int8"], quantised["int8-t0"]
    embeds = q8.probe.vocab_matrix()[_ids(q8, batch=2, length=5)].clone()
    embeds[1, :, 3] = 50.0  # an outlier feature in the other prompt only
    for q, depends in [(q8, True), (q0, False)]:
        alone = q.probe.embeds_states(embeds[:1], 1)[1][0]
        batched = q.probe.embeds_states(embeds, 1)[1][0]
        assert (not torch.equal(alone, batched)) is depends


def test_gpt2_conv1d_layers_are_quantised_too():
    gpt2 = lminvert.load_model("tiny-gpt2")
    q = quantize(gpt2, "nf4")
    assert quantized_layers(q) == sum(1 for m in gpt2.model.modules() if type(m).__name__ == "Conv1D") > 0
    ids = _ids(gpt2)
    ref, ours = gpt2.probe.states(ids, 2)[2], q.probe.states(ids, 2)[2]
    assert 1e-4 < float((ours - ref).norm() / ref.norm()) < 0.5


def test_errors_are_one_line(base, monkeypatch, tmp_path):
    with pytest.raises(LminvertError, match="unknown quantisation scheme 'int3'"):
        quantize(base, "int3")
    with pytest.raises(LminvertError, match=r"float32 model on the CPU; .tiny-llama. is bfloat16 on cpu: load it with"):
        quantize(lminvert.load_model("tiny-llama", dtype="bfloat16"), "nf4")
    with pytest.raises(LminvertError, match="unknown scheme"):
        experiments.run("quantization", tmp_path / "bad", quick=True, models=("tiny-llama",), schemes=["int3"])
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(LminvertError, match=r"pip install 'lminvert\[quant\]'"):
        quantize(base, "nf4")
    with pytest.raises(LminvertError, match=r"pip install 'lminvert\[quant\]'"):
        experiments.run("quantization", tmp_path / "missing", quick=True, models=("tiny-llama",), progress=False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantization")
    experiments.run("quantization", out, quick=True, models=("tiny-llama",), progress=False)
    return out


def test_quick_experiment_rows_tables_and_figures(quick):
    doc = json.loads((quick / "results.json").read_text())
    rows = doc["rows"]
    schemes = ["float32", *SCHEMES]
    collisions = [r for r in rows if r["test"] == "collisions"]
    assert {(r["scheme"], r["layer"]) for r in collisions} == {(s, layer) for s in schemes for layer in ("1", "2")}
    assert all(r["below_threshold"] == 0 and r["min_distance"] > 1e-3 for r in collisions)
    assert all(r["rounding_noise_max"] is not None for r in collisions)
    inversions = [r for r in rows if r["test"] == "inversion"]
    assert sorted(r["scheme"] for r in inversions) == sorted(schemes)
    assert all(r["exact"] and r["wrong_unflagged"] == 0 for r in inversions)
    shifts = {r["scheme"]: r["state_shift"] for r in inversions}
    assert shifts["float32"] == 0 and all(shifts[s] > 1e-4 for s in SCHEMES)
    markdown = (quick / "results.md").read_text()
    assert "nf4 / float32" in markdown and "paper: 4-bit Llama-3.1-8B" in markdown and "bitsandbytes" in markdown
    for spec in doc["summary"]["figures"]:
        assert (quick / "figures" / f"{spec['name']}.png").stat().st_size > 5000


def test_a_quantised_model_is_never_screened(base, quantised):
    """Screening runs plain linear layers in bfloat16: a quantised model's (bitsandbytes subclasses of nn.Linear with
    packed weights) keep their own forward, so it is off by default and refused when asked for."""
    from lminvert.forward import encode
    from lminvert.invert import invert

    q = quantised["nf4"]
    assert not q.probe.can_screen
    states = encode(q, [[5, 900, 31000]], 1)
    with pytest.raises(LminvertError, match="quantised"):
        invert(q, states, screen=True)
    (result,) = invert(q, states)
    assert result.token_ids == [5, 900, 31000] and not any(p.screened_out for p in result.positions)
