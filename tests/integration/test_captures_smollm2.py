"""The real default model's states as people capture them: the layer found from the states alone, a wrong --layer
refused in one line, random numbers diagnosed in one line, `lminvert inspect`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import lminvert
from lminvert.captures import library_layer
from lminvert.errors import LminvertError
from lminvert.invert import invert
from lminvert.invert.layerfit import fit_layers
from lminvert.states import HiddenStates

from ..conftest import run_cli
from ..libraries import nnsight_states, transformer_lens_cache
from ..unit.test_foreign import padded_capture

TEXTS = [
    "Contact Jane Doe at jane.doe@example.com about invoice 4471.",
    "The meeting moved to Thursday at 3pm in room B.",
    "def add(a, b): return a + b",
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layer_is_found_from_padded_transformers_captures(dtype):
    model = lminvert.load_model("smollm2-135m", dtype=dtype)
    prompts = [model.tokenize(t) for t in TEXTS]
    n = model.probe.n_layers
    for index, name in ((0, "0"), (1, "1"), (14, "14"), (15, "15"), (n - 1, str(n - 1)), (n, "final")):
        for side in ("left", "right"):
            fit = fit_layers(model, padded_capture(model, prompts, index, side))
            assert (fit.best, fit.fits, fit.decisive) == (name, True, True), (index, side, fit.describe())
    own = model.probe.states(torch.tensor([prompts[0]]), [n])[model.probe.layer(n)][0]
    assert fit_layers(model, [own]).best == str(n)  # lminvert's layer 30: before the final norm


def test_a_capture_inverts_without_its_layer():
    model = lminvert.load_model("smollm2-135m")
    prompts = [model.tokenize(t) for t in TEXTS[:2]]
    (result, second) = invert(model, HiddenStates.from_array(padded_capture(model, prompts, 1, "right")))
    assert [result.token_ids, second.token_ids] == prompts
    assert any("layer 1 found from the states" in note for note in result.notes)


def test_a_wrong_layer_and_random_numbers_are_one_line_errors(tmp_path):
    model = lminvert.load_model("smollm2-135m")
    states = model.probe.states(torch.tensor([model.tokenize(TEXTS[0])]), [15])[model.probe.layer(15)][0]
    np.save(tmp_path / "leak.npy", states.numpy())
    np.save(tmp_path / "random.npy", np.random.default_rng(0).standard_normal((20, 576)).astype(np.float32))
    # at the embeddings' scale, random numbers fit layer 0's covariance, but lie far from every token's embedding
    np.save(tmp_path / "small.npy", 0.03 * np.random.default_rng(1).standard_normal((20, 576)).astype(np.float32))
    np.save(tmp_path / "zeros.npy", np.zeros((20, 576), np.float32))
    np.save(tmp_path / "window.npy", states[6:].numpy())  # a window cut from a longer prompt: no first position
    for args, says in (
        (["window.npy", "--layer", "15"], "look like smollm2-135m's layer 15"),
        (["window.npy"], "look like smollm2-135m's layer 15"),
        (["leak.npy", "--layer", "14"], "--layer 15"),
        (["leak.npy", "--layer", "15", "--source-library", "hf", "--layer", "16"], "--layer 15"),
        (["random.npy"], "fit no layer"),
        (["random.npy", "--layer", "15"], "fit no layer"),
        (["small.npy"], "beyond every token's embedding"),
        (["zeros.npy"], "all zeros"),  # once taken for layer 0, then refused there as beyond every embedding
        (["zeros.npy", "--layer", "0"], "all zeros"),
        (["zeros.npy", "--layer", "15"], "all zeros"),
    ):
        proc = run_cli("invert", str(tmp_path / args[0]), "--model", "smollm2-135m", *args[1:])
        assert proc.returncode != 0 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = run_cli("inspect", str(tmp_path / "leak.npy"), "--model", "smollm2-135m", "--json", check=True)
    doc = json.loads(proc.stdout)
    assert doc["layer"]["best"] == "15" and doc["command"].endswith("--layer 15") and "window" not in doc
    proc = run_cli("inspect", str(tmp_path / "window.npy"), "--model", "smollm2-135m", "--json", check=True)
    assert "look like smollm2-135m's layer 15" in json.loads(proc.stdout)["window"]


@pytest.mark.parametrize(("library", "inverted"), [("nnsight", 14), ("tl", 0)])
def test_other_libraries_captures_invert_at_layers_1_15_30(library, inverted):
    """nnsight's model.model.layers[i].output and TransformerLens' blocks.{i}.hook_resid_post (compatibility mode:
    folded RMSNorm weights, the same states up to rounding) at blocks 0, 14 and 29: layers 1, 15 and 30 found from
    the states; one block's capture per library inverted, every token right, nothing below confident (inverting the
    others is bench_foreign.py's: a cold cache's float calibration at each layer costs a minute)."""
    model = lminvert.load_model("smollm2-135m")
    ids = model.tokenize(TEXTS[0])
    n = model.probe.n_layers
    if library == "tl":
        cache = transformer_lens_cache(model, ids, compatibility=True)
    for block in (0, 14, n - 1):
        states = nnsight_states(model, ids, block) if library == "nnsight" else cache[f"blocks.{block}.hook_resid_post"]
        fit = fit_layers(model, [states])
        assert (fit.best, fit.decisive) == (library_layer(str(block), library, n), True), fit.describe()
        if block == inverted:
            (result,) = invert(model, states)
            assert result.layer == fit.best and result.token_ids == ids
            assert "uncertain" not in result.verdicts, (block, result.verdicts)


def test_states_of_another_model_of_the_same_width_fit_no_layer():
    """A (random) Llama whose hidden size is SmolLM2's, 576: its states at every layer are refused in one line."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = lminvert.load_model("smollm2-135m")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=model.probe.vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=3,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    other = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        hidden = other(input_ids=torch.tensor([model.tokenize(TEXTS[0])]), output_hidden_states=True).hidden_states
    for states in hidden:
        with pytest.raises(LminvertError, match="fit no layer"):
            invert(model, states[0])
