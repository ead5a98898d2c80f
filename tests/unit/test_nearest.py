"""The nearest other token over the whole vocabulary (:mod:`lminvert.invert.nearest`), and the calibration's gap
between tokens against it: the fraction of that gap the acceptor uses must lie under every position's nearest; the
calibration's hardest candidates (:func:`lminvert.invert.nearest.near_inputs`)."""

from __future__ import annotations

import pytest
import torch

import lminvert
from lminvert.invert.acceptor import TOKEN_GAP_SAFETY
from lminvert.invert.nearest import near_inputs, nearest_others
from lminvert.invert.tolerance import calibrate


def _prompts(model) -> list[list[int]]:
    text = list(model.tokenize("The harbour froze early that winter, and the ferry stopped running.", 8))
    noise = torch.randint(0, model.probe.vocab_size, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    return [text, noise]


@pytest.mark.parametrize(("name", "dtype"), [("tiny-llama", "float32"), ("tiny-gemma3", "bfloat16")])
def test_a_quarter_of_the_calibrated_gap_lies_under_every_positions_nearest_token(name, dtype):
    model = lminvert.load_model(name, dtype=dtype)
    layers = [model.probe.layer(1), model.probe.layer(2)]
    gaps = {layer: calibrate(model, layer).gap for layer in layers}
    for prompt in _prompts(model):
        for t in (0, 5):
            found = nearest_others(model, prompt, t, layers)
            for layer in layers:
                near = found[layer]
                assert near.token != prompt[t] and 0 <= near.token < model.probe.vocab_size
                assert near.distance > gaps[layer] / TOKEN_GAP_SAFETY, (prompt, t, int(layer), near, gaps[layer])
                # the true token's nearest input vectors among the calibration's candidates find a position's nearest
                # token, or one as near, here: the whole gap lies under it (random candidates alone: up to 1.20x it)
                assert near.distance >= gaps[layer], (prompt, t, int(layer), near, gaps[layer])


def test_the_hardest_candidates_are_the_nearest_input_vectors_by_angle_without_the_token_or_its_twins():
    model = lminvert.load_model("tiny-llama")
    token, twin = 7, 11
    weights = model.probe.vocab_matrix()  # the embedding itself: edited in place, then restored
    saved = weights.detach().clone()
    try:
        with torch.no_grad():
            weights[twin] = weights[token]  # token 11 made token 7's bit-identical twin
        edited = weights.detach().float().clone()
        found = near_inputs(model, torch.tensor([token, 3]), 5)
    finally:
        with torch.no_grad():
            weights.copy_(saved)
    unit = edited / edited.norm(dim=1, keepdim=True)
    for row, t in enumerate((token, 3)):
        cosine = unit @ unit[t]
        cosine[[t, twin] if t == token else [t]] = -2.0
        assert found[row].tolist() == cosine.topk(5).indices.tolist()
    assert token not in found[0].tolist() and twin not in found[0].tolist()


def test_the_nearest_token_is_where_a_plain_forward_puts_it_and_none_is_nearer():
    model = lminvert.load_model("tiny-qwen2")
    probe = model.probe
    prompt, t = _prompts(model)[0], 4
    layer = probe.layer(2)
    near = nearest_others(model, prompt, t, [layer], chunk=4096)[layer]
    assert near.own < 1e-5  # the true token's verification agrees with the plain forward
    rows = torch.tensor([[*prompt[:t], prompt[t]], [*prompt[:t], near.token]])
    h, other = probe.states(rows, layer)[layer][:, t].double()
    assert float((other - h).norm() / h.norm()) == pytest.approx(near.distance, rel=1e-4)
    # a sample of other tokens through the plain forward: none lies nearer
    sample = torch.randint(0, probe.vocab_size, (256,), generator=torch.Generator().manual_seed(1))
    sample = sample[sample != prompt[t]]
    states = probe.states(torch.tensor([[*prompt[:t], int(x)] for x in sample]), layer)[layer][:, t].double()
    assert float(((states - h).norm(dim=1) / h.norm()).min()) >= near.distance * (1 - 1e-4)
    with pytest.raises(ValueError, match="outside the prompt"):
        nearest_others(model, prompt, len(prompt), [layer])
