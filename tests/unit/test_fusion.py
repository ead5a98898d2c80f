"""The reading's weight in the proposal's fused source, fitted per layer (:mod:`lminvert.invert.fusion`)."""

from __future__ import annotations

import math

import pytest
import torch

import lminvert
from lminvert.forward import prompt_states
from lminvert.invert import fusion
from lminvert.invert.reading import input_distances, read, reading_map
from lminvert.models.loading import LoadedModel

from ..conftest import small_vocab_llama


@pytest.fixture(scope="module")
def tiny():
    return lminvert.load_model("tiny-llama")


def _plain_costs(model, prompts, layer, reading) -> list[float]:
    """The mean log2(2 + rank) of the true token under each weight, computed the plain way: the prior's and the
    reading's log-softmax over the whole vocabulary, summed, every position at once, ranked by sorting."""
    probe = model.probe
    top = probe.layer(probe.n_layers)
    states = prompt_states(model, prompts, [layer, top], progress=False)
    costs = []
    for weight in fusion.WEIGHTS:
        total, count = 0.0, 0
        for row, ids in zip(states, prompts, strict=True):
            prior = probe.next_token_logits(row[top][:-1]).float().log_softmax(-1)
            own = (-input_distances(model, read(reading, row[layer])[1:], half=True)).log_softmax(-1)
            score = prior + weight * own
            order = score.argsort(dim=1, descending=True, stable=True)
            for t, token in enumerate(ids[1:]):
                place = int((order[t] == token).nonzero()[0])
                ahead = int((score[t] > score[t, token]).sum())  # ties with the true token do not count
                assert place >= ahead
                total += math.log2(2 + ahead)
                count += 1
        costs.append(total / count)
    return costs


def test_the_weight_chosen_ranks_the_true_token_best_among_those_tried(tiny):
    """The fit's chunked ranking against a plain one: the weight it chose has the lowest plain cost (the one nearest
    1 among equal costs)."""
    layer = tiny.probe.layer(2)
    reading = reading_map(tiny, layer)
    prompts = fusion.training_prompts(tiny, text=fusion.PROMPTS, random=0, length=fusion.LENGTH, seed=fusion.SEED)
    assert len(prompts) == fusion.PROMPTS
    chosen = fusion._fit(tiny, prompts, {layer: reading})[layer]
    costs = _plain_costs(tiny, prompts, layer, reading)
    best = min(costs)
    assert costs[fusion.WEIGHTS.index(chosen)] == pytest.approx(best, abs=1e-9)
    ties = [w for w, c in zip(fusion.WEIGHTS, costs, strict=True) if c == pytest.approx(best, abs=1e-9)]
    assert abs(math.log2(chosen)) == min(abs(math.log2(w)) for w in ties)


def test_a_reading_that_knows_the_token_is_believed_over_a_random_prior_and_one_that_does_not_is_not(tiny):
    """A reading that returns each position's true input vector (which it ranks first: ``2 e.e_v - |e_v|^2`` is
    highest at ``e_v = e``, though softly) is believed over a random model's prior (a weight above 1, and no weight
    tried ranks better: a larger weight can only lift the true token); one that returns noise only dilutes the prior
    (the smallest weight)."""
    layer = tiny.probe.layer(1)
    prompts = fusion.training_prompts(tiny, text=fusion.PROMPTS, random=0, length=fusion.LENGTH, seed=fusion.SEED)
    vocab = tiny.probe.vocab_matrix(torch.float32)
    truth = {}
    for row, ids in zip(prompt_states(tiny, prompts, [layer], progress=False), prompts, strict=True):
        truth[row[layer][0].sum().item()] = vocab[torch.tensor(ids)]  # keyed by the prompt's first state

    def knows(inputs: torch.Tensor) -> torch.Tensor:
        key = min(truth, key=lambda k: abs(k - inputs[0, : tiny.probe.hidden_size].sum().item()))
        return truth[key][: len(inputs)]

    def noise(inputs: torch.Tensor) -> torch.Tensor:
        return torch.randn(len(inputs), tiny.probe.hidden_size, generator=torch.Generator().manual_seed(1))

    chosen = fusion._fit(tiny, prompts, {layer: knows})
    costs = _plain_costs(tiny, prompts, layer, knows)
    assert chosen[layer] > 1 and costs[fusion.WEIGHTS.index(chosen[layer])] == pytest.approx(costs[-1], abs=1e-9)
    assert costs == sorted(costs, reverse=True)
    chosen = fusion._fit(tiny, prompts, {layer: noise})
    assert chosen[layer] == min(fusion.WEIGHTS)


def test_the_weight_is_fitted_once_per_reading_and_the_switch_gives_the_default(isolated_cache, monkeypatch):
    tiny = lminvert.load_model("tiny-llama")  # its own memo: nothing fitted yet
    layer = tiny.probe.layer(2)
    reading = reading_map(tiny, layer)
    first = fusion.fitted_weight(tiny, layer, reading, 1.0)
    assert first in fusion.WEIGHTS

    def refit(*args, **kwargs):
        raise AssertionError("fitted again")

    monkeypatch.setattr(fusion, "_fit", refit)
    assert fusion.fitted_weight(tiny, layer, reading, 1.0) == first  # cached for this reading
    with pytest.raises(AssertionError, match="fitted again"):  # another reading: its own weight
        fusion.fitted_weight(tiny, layer, reading * 1.5, 1.0)
    monkeypatch.setattr(fusion, "FIT", False)
    assert fusion.fitted_weight(tiny, layer, reading * 1.5, 0.75) == 0.75


def test_a_model_without_text_keeps_the_default_weight_and_seeks_no_text_again(monkeypatch):
    model = LoadedModel.wrap("small-vocab", small_vocab_llama())  # no tokenizer: no text windows
    layer = model.probe.layer(2)
    reading = reading_map(model, layer)
    assert fusion.fitted_weight(model, layer, reading, 0.75) == 0.75
    assert model.memo.get(fusion.NO_TEXT) is True

    def sought(*args, **kwargs):
        raise AssertionError("text sought again")

    monkeypatch.setattr(fusion, "training_prompts", sought)
    assert fusion.fitted_weight(model, layer, reading, 0.5) == 0.5
