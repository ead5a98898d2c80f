"""The layer probe against transformers' own forward, on tiny random models of each architecture."""

from __future__ import annotations

import math

import pytest
import torch

import lminvert
from lminvert.errors import LminvertError

from ..conftest import FAMILIES, TINY


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    return lminvert.load_model(request.param)


def _ids(model, length=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.probe.vocab_size, (2, length), generator=gen)


def test_states_match_transformers(tiny):
    probe = tiny.probe
    ids = _ids(tiny)
    with torch.no_grad():
        ref = tiny.model(input_ids=ids, output_hidden_states=True).hidden_states
    layers = [*range(probe.n_layers + 1), "final"]
    ours = probe.states(ids, layers)
    for layer in range(probe.n_layers):  # blocks below the top: transformers gives them un-normed
        torch.testing.assert_close(ours[layer], ref[layer], rtol=0, atol=0)
    # transformers' last entry has the final norm applied; ours at L does not, 'final' does
    torch.testing.assert_close(ours[probe.final], ref[-1], rtol=0, atol=0)
    torch.testing.assert_close(probe.final_norm(ours[probe.n_layers]), ours[probe.final])
    assert not torch.allclose(ours[probe.n_layers], ours[probe.final])


def test_layer_zero_is_what_the_model_uses(tiny):
    if tiny.name not in TINY:
        pytest.skip("layer 0 of this family is checked against transformers' hidden_states[0] above")
    probe = tiny.probe
    ids = _ids(tiny)
    zero = probe.states(ids, 0)[0]
    emb = probe.embed(ids)
    if tiny.model.config.model_type == "gpt2":
        emb = emb + tiny.model.transformer.wpe(torch.arange(ids.shape[1]))[None]
    torch.testing.assert_close(zero, emb)
    if tiny.model.config.model_type == "gemma3_text":  # Gemma scales by sqrt(d) inside its embedding module
        raw = tiny.model.get_input_embeddings().weight[ids]
        assert torch.allclose(zero, raw * math.sqrt(probe.hidden_size), rtol=1e-3)
        assert not torch.allclose(zero, raw)


def test_truncated_forward_runs_nothing_above(tiny):
    probe = tiny.probe
    calls = []
    handles = [b.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, b in enumerate(probe.blocks)]
    head = tiny.model.get_output_embeddings()
    handles.append(head.register_forward_hook(lambda m, a, o: calls.append("head")))
    try:
        probe.states(_ids(tiny), 1)
    finally:
        for h in handles:
            h.remove()
    assert calls == [0]


def test_a_first_position_state_lifted_above_its_layer_is_its_tokens_state_alone_there(tiny):
    probe = tiny.probe
    top = probe.n_layers
    states = probe.states(_ids(tiny)[:1], list(range(top + 1)))
    for low, upper in ((0, 1), (1, top), (0, top)):
        if upper <= low:
            continue
        lifted = probe.states_above(states[probe.layer(low)][:, :1], low, upper)  # position 0 alone
        want = states[probe.layer(upper)][0, 0]  # the same position in the whole sequence
        torch.testing.assert_close(lifted[0, 0], want, rtol=1e-4, atol=1e-5 * float(want.norm()))
    with pytest.raises(ValueError):
        probe.states_above(states[probe.layer(1)][:, :1], 1, 1)


@pytest.mark.parametrize("layer", [1, -1])
def test_cached_continuation_equals_full_forward(tiny, layer):
    probe = tiny.probe
    ids = _ids(tiny, 8)[0]
    full = probe.states(ids, layer)[probe.layer(layer)][0]
    prefix = probe.prefix(ids[:5].tolist(), layer)
    cands = torch.tensor([int(ids[5]), 3, int(ids[5]), 7])
    got = probe.continuation(prefix, token_ids=cands)
    scale = full[5].norm()
    assert (got[0] - full[5]).norm() <= 1e-5 * scale
    assert (got[2] - full[5]).norm() <= 1e-5 * scale
    assert (got[1] - full[5]).norm() > 1e-3 * scale
    # extending the prefix one token reuses the cache and stays exact
    prefix = probe.extend(prefix, int(ids[5]))
    got = probe.continuation(prefix, token_ids=ids[6:7])
    assert (got[0] - full[6]).norm() <= 1e-5 * full[6].norm()
    # the empty prefix: position 0
    first = probe.continuation(probe.prefix([], layer), token_ids=ids[:1])
    assert (first[0] - full[0]).norm() <= 1e-5 * full[0].norm()


def test_deferred_tokens_join_the_cache_with_the_next_forward(tiny):
    """A prefix grown by deferred tokens (no forward) reads as one grown by forwards once caught up (one forward for
    all of them, an empty prefix's too), or when the next token grows it; a forward over it before that is refused."""
    probe = tiny.probe
    ids = _ids(tiny, 8)[0].tolist()
    reference = probe.prefix(ids[:6], 2)
    cands = torch.tensor([ids[6], 3, 11])
    deferred = probe.defer(probe.defer(probe.prefix(ids[:4], 2), [ids[4]]), [ids[5]])
    assert deferred.behind == 2 and deferred.rows == [ids[:6]]
    with pytest.raises(ValueError, match="catch_up"):
        probe.continuation(deferred, token_ids=cands)
    assert probe.catch_up(deferred) and deferred.behind == 0 and not probe.catch_up(deferred)
    torch.testing.assert_close(
        probe.continuation(deferred, token_ids=cands),
        probe.continuation(reference, token_ids=cands),
        rtol=1e-4,
        atol=1e-5,
    )
    grown = probe.advance_rows(probe.defer(probe.prefix(ids[:5], 2), [ids[5]]), [ids[6]])[0]
    torch.testing.assert_close(
        probe.continuation(grown, token_ids=cands[1:]),
        probe.continuation(probe.prefix(ids[:7], 2), token_ids=cands[1:]),
        rtol=1e-4,
        atol=1e-5,
    )
    empty = probe.defer(probe.defer(probe.prefix([], 2), [ids[0]]), [ids[1]])  # nothing cached yet: all caught up
    assert empty.cache is None and empty.behind == 2 and probe.catch_up(empty)
    torch.testing.assert_close(
        probe.continuation(empty, token_ids=cands),
        probe.continuation(probe.prefix(ids[:2], 2), token_ids=cands),
        rtol=1e-4,
        atol=1e-5,
    )


def test_continuation_with_vectors_has_gradient(tiny):
    probe = tiny.probe
    ids = _ids(tiny, 6)[0]
    prefix = probe.prefix(ids[:4].tolist(), 2)
    vec = probe.embed(ids[4:5]).detach().clone().requires_grad_(True)
    by_vec = probe.continuation(prefix, embeds=vec)
    by_id = probe.continuation(prefix, token_ids=ids[4:5])
    torch.testing.assert_close(by_vec.detach(), by_id)
    by_vec.square().sum().backward()
    assert vec.grad is not None and vec.grad.norm() > 0


def test_layer_resolution(tiny):
    probe = tiny.probe
    n = probe.n_layers
    assert probe.layer(-1) == n
    assert probe.layer(f"-{n}") == 1
    assert probe.layer("final") == n + 1
    for bad in [n + 1, -n - 1, "x"]:
        with pytest.raises(LminvertError, match="layer"):
            probe.layer(bad)


def test_vocab_matrix_uses_embedding_module(tiny):
    probe = tiny.probe
    ids = torch.tensor([0, 5, probe.vocab_size - 1])
    torch.testing.assert_close(probe.vocab_matrix()[ids], probe.embed(ids))


@pytest.mark.parametrize("half", [False, True])
def test_vocabulary_products_for_rankings(monkeypatch, half):
    """probe.vocab_dots, the linear policy's ranking product: the float32 product, or (on a CPU, by default) one
    through a scaled float16 copy of the vocabulary, within 1e-3 of the largest product at any scale of the
    vector; the zero vector gives zeros."""
    from lminvert.models import vocabulary as probe_module

    monkeypatch.setattr(probe_module, "HALF_DOTS", half)
    probe = lminvert.load_model("tiny-llama").probe  # a new probe: the choice is made at its first product
    vocab = probe.vocab_matrix(torch.float32).double()
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-4, 1.0, 1e4):
        vector = torch.randn(probe.hidden_size, generator=gen) * scale
        got, ref = probe.vocab_dots(vector), vocab @ vector.double()
        assert got.dtype == torch.float32 and got.shape == (probe.vocab_size,)
        error = float((got.double() - ref).abs().max() / ref.abs().max())
        assert error < (1e-3 if half else 1e-6), (scale, error)
    assert bool(probe._vocab_half) == half
    assert not probe.vocab_dots(torch.zeros(probe.hidden_size)).any()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_ranking_logits_of_one_state(monkeypatch, name):
    """next_token_logits(ranking=True) on one state: where the head is the vocabulary matrix itself (tiny-gpt2's tied
    head), vocab_dots' product, within 1e-3 of the largest logit of the head's own; elsewhere (tiny-llama's untied
    head) and for several states, the head's own logits exactly."""
    from lminvert.models import vocabulary

    probe = lminvert.load_model(name).probe
    calls, real = [], vocabulary.vocab_dots
    monkeypatch.setattr(vocabulary, "vocab_dots", lambda p, v: calls.append(v) or real(p, v))
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(probe.hidden_size, generator=gen) * 3
    reference = probe.next_token_logits(state)
    got = probe.next_token_logits(state, ranking=True)
    tied = name == "tiny-gpt2"
    assert len(calls) == int(tied)
    error = float((got.double() - reference.double()).abs().max() / reference.abs().max())
    assert error < (1e-3 if tied else 1e-12), error
    many = torch.randn(3, probe.hidden_size, generator=gen)
    torch.testing.assert_close(probe.next_token_logits(many, ranking=True), probe.next_token_logits(many))
    assert len(calls) == int(tied)


def test_lower_precision_is_selectable():
    model = lminvert.load_model("tiny-llama", dtype="bfloat16")
    out = model.probe.states(torch.tensor([[1, 2, 3]]), 1)[1]
    assert out.dtype == torch.bfloat16


def test_hooks_that_edit_the_computation_are_seen_and_transformers_own_are_not(tiny):
    from lminvert.models.probe import has_hooks

    model = lminvert.load_model("tiny-llama")
    model.probe.states(torch.tensor([[1, 2, 3]]), [1])  # transformers may install its own capture hooks on use
    assert not has_hooks(model.model)
    handle = model.probe.blocks[0].register_forward_hook(lambda module, args, out: out)
    assert has_hooks(model.model)
    handle.remove()
    assert not has_hooks(model.model)
