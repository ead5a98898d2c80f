"""The first block's algebra (:mod:`lminvert.invert.firstblock`): the prompt's tokens and their order read from one
last state, proposals only (verified and judged elsewhere); blocks of another shape declined."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lminvert
from lminvert.invert.firstblock import FirstBlock, _lengths, first_block
from lminvert.models import LoadedModel
from lminvert.paths import clock


def _small(config_class, network_class, seed: int, name: str, biases: bool = False) -> LoadedModel:
    """A random model of SmolLM2's shape, scaled down: wide enough for the algebra (256), a small vocabulary;
    ``biases``: random ones on the first block's queries, keys and values (a zero one would prove nothing)."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    network = network_class(config)
    for projection in ("q_proj", "k_proj", "v_proj") if biases else ():
        torch.nn.init.normal_(getattr(network.model.layers[0].self_attn, projection).bias, std=0.5)
    return LoadedModel.wrap(name, network)


@pytest.fixture(scope="module")
def small():
    return _small(LlamaConfig, LlamaForCausalLM, 0, "small-llama")


def _assert_decomposes(model) -> FirstBlock:
    """``x + mlp(norm2(x))`` of the residual computed here is the model's own layer-1 state."""
    block = first_block(model)
    assert block is not None
    ids = _ids(model, 6, 0)
    with torch.no_grad():
        mine = block.mlp_residual(block.residual(ids)).float()
    assert torch.allclose(mine, _last(model, ids), rtol=1e-4, atol=1e-5)
    return block


def test_a_qwen2_first_block_with_biases_is_read_too():
    """Qwen2's queries, keys and values carry biases: the decomposition still reproduces its layer-1 state."""
    _assert_decomposes(_small(Qwen2Config, Qwen2ForCausalLM, 1, "small-qwen2", biases=True))


def _ids(model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(model.probe.vocab_size, generator=gen)[:length].tolist()


def _last(model, ids: list[int]) -> torch.Tensor:
    layer = model.probe.layer(1)
    return model.probe.states(torch.tensor([ids]), [layer])[layer][0, -1].float()


def _proposed(model, ids: list[int], longest: int, normalised: bool = False) -> list[tuple[int, ...]]:
    """The proposals from the last state (its direction only where ``normalised``)."""
    vector, deadline = _last(model, ids), clock() + 60
    if normalised:
        vector = vector / vector.norm()
    batches = first_block(model).proposals(vector, [ids[-1]], longest, deadline, normalised=normalised)
    return [p for batch in batches for p in batch]


def test_the_decomposition_reproduces_the_models_first_block_and_other_shapes_are_declined(small):
    """``x + mlp(norm2(x))`` of the residual computed here is the model's layer-1 state (Llama's shape); GPT-2 (no
    rotary embedding), Gemma-3 (norms around the MLP, query and key norms) and states too narrow to single out a
    prompt's tokens (the tiny test Llama, 64 wide) are declined, not misread."""
    assert first_block(small) is _assert_decomposes(small)  # made once per model
    for name in ("tiny-gpt2", "tiny-gemma3", "tiny-llama"):
        assert FirstBlock.of(lminvert.load_model(name)) is None, name


@pytest.mark.parametrize("seed", [1, 2])
def test_the_proposals_hold_the_prompt_of_distinct_tokens(small, seed):
    """From a random six-token prompt's layer-1 last state alone: some proposal of six tokens is the prompt; every
    proposal ends in the last token given, at every length from 2 to the longest asked."""
    ids = _ids(small, 6, seed)
    proposed = _proposed(small, ids, 6)
    assert tuple(ids) in proposed
    assert all(p[-1] == ids[-1] for p in proposed) and {len(p) for p in proposed} == set(range(2, 7))


def test_from_the_direction_alone_the_prompt_is_proposed_and_comes_back_through_invert(small):
    """A normalised vector (an embedding API's): the state's norm is found with the residual, the prompt is among the
    proposals, and ``lminvert.invert(..., normalised=True)`` gives it back, every position claimed."""
    ids = _ids(small, 6, 5)
    assert tuple(ids) in _proposed(small, ids, 6, normalised=True)
    vector = _last(small, ids)
    (result,) = lminvert.invert(
        small, vector / vector.norm(), 1, leak="last", normalised=True, max_seconds=30, max_length=6
    )
    assert result.token_ids == ids and set(result.verdicts) <= {"certified", "confident"}


def test_a_repeated_token_is_placed_twice(small):
    """A prompt holding a token twice (its weight the sum of two positions'): still among the proposals."""
    a, b, c, d = _ids(small, 4, 3)
    ids = [a, b, a, c, d]
    assert tuple(ids) in _proposed(small, ids, 5)


def test_one_vector_at_layer_1_comes_back_certified_through_invert(small):
    """``lminvert.invert(..., leak="last")`` at layer 1: a five-token prompt found by the algebra and certified."""
    ids = _ids(small, 5, 4)
    (result,) = lminvert.invert(small, _last(small, ids), 1, leak="last", max_seconds=30, max_length=5)
    assert result.token_ids == ids and set(result.verdicts) == {"certified"}


@pytest.mark.parametrize(("distinct", "longest", "expected"), [
    (5, 8, [5, 6, 7, 8, 4, 3, 2]), (0, 3, [2, 3]), (1, 2, [2]), (9, 8, [8, 7, 6, 5, 4, 3, 2]),
])  # fmt: skip
def test_lengths_are_tried_from_the_fits_distinct_tokens_up_then_down_each_once(distinct, longest, expected):
    """A prompt holds at least as many tokens as its distinct ones: those lengths first, every length once."""
    assert _lengths(distinct, longest) == expected
