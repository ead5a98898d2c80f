"""The fast engine against the reference SIPIT (:mod:`lminvert.invert.reference`): same tokens wherever both decide."""

from __future__ import annotations

import pytest
import torch

import lminvert
from lminvert.invert import Float
from lminvert.invert.acceptor import UNCERTAIN
from lminvert.invert.engine import bound_source
from lminvert.invert.reference import reference_invert
from lminvert.states import HiddenStates

FAMILIES = ["tiny-llama", "tiny-gpt2", "tiny-gemma3"]  # rotary + RMSNorm, learned positions + LayerNorm, sandwich norms
LAYERS = [1, -1]
BATCH = 2048  # candidates per reference forward: fewer, larger forwards than the default (the answer is the same)


def random_prompts(vocab: int, lengths: tuple[int, ...] = (5, 6, 5), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    return lminvert.load_model(request.param)


@pytest.mark.parametrize("layer", LAYERS)
def test_engine_agrees_with_reference_on_exact_states(tiny, layer):
    prompts = random_prompts(tiny.probe.vocab_size, seed=len(tiny.name))
    states = lminvert.encode(tiny, prompts, layer=layer)
    fast = lminvert.invert(tiny, states)
    for i, ids in enumerate(prompts):
        ref = reference_invert(tiny, states.states[i], layer, batch=BATCH, seed=i)
        assert ref.verdicts.count(UNCERTAIN) == 0, ref.verdicts  # exact states: every position decided
        assert fast[i].uncertain_positions == [], fast[i].verdicts
        assert ref.token_ids == ids
        assert fast[i].token_ids == ref.token_ids
        assert all(0 < n <= tiny.probe.vocab_size for n in ref.candidates_checked)


def right_padded_states(model, prompts: list[list[int]], layer: int) -> list[torch.Tensor]:
    """Every prompt's states from one right-padded batch (pad id 0, masked): not what a single-prompt forward gives."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    states = model.probe.states(ids, [layer], attention_mask=mask)[model.probe.layer(layer)].float().cpu()
    return [states[i, : len(p)] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-gemma3"])
def test_engine_agrees_with_reference_on_foreign_states(name):
    model = lminvert.load_model(name)
    layer = 1
    prompts = random_prompts(model.probe.vocab_size, lengths=(6, 3, 5), seed=7)
    observed = right_padded_states(model, prompts, layer)
    source = bound_source(model, model.probe.layer(layer), Float())
    fast = lminvert.invert(model, HiddenStates.from_array(observed), layer=layer, source=source)
    decided = 0
    for i, ids in enumerate(prompts):
        ref = reference_invert(model, observed[i], layer, source=source, batch=BATCH, seed=i)
        for t, truth in enumerate(ids):
            if UNCERTAIN in (ref.verdicts[t], fast[i].verdicts[t]):
                continue
            decided += 1
            assert fast[i].token_ids[t] == ref.token_ids[t] == truth, (i, t, ref.verdicts, fast[i].verdicts)
    assert decided >= sum(map(len, prompts)) // 2  # the comparison is not vacuous: most positions were decided
