"""Every causal-LM family: invert(encode(x)) == x at the first, middle and last block (parity with transformers is in
test_probe.py), and an architecture the probe cannot map is a one-line error, never a wrong layer."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.models import LayerProbe, LoadedModel

from ..conftest import FAMILIES, TINY

VOCAB = 49152


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f not in TINY])  # the core four: test_invert.py
def family(request):
    return lminvert.load_model(request.param)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), layer=st.sampled_from(["1", "middle", "-1"]))
def test_invert_encode_roundtrip_on_every_family(family, ids, layer):
    states = encode(family, [ids], layer)
    (result,) = invert(family, states)
    assert result.token_ids == ids
    assert result.uncertain_positions == []


@pytest.mark.parametrize("name", FAMILIES)
def test_upper_blocks_run_on_given_states_reproduce_the_last_hidden_state(name):
    """The next-token prior's forward (probe.final_from): the blocks above layer l, run on the observed layer-l
    states of a batch of prompts (one right-padded), give what transformers' own forward gives at its last layer."""
    model = lminvert.load_model(name)
    probe = model.probe
    prompts = [[17, 4021, 3300, 17, 5, 912], [9, 8, 7]]
    with torch.no_grad():
        ref = [model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0] for ids in prompts]
    ran: list[int] = []
    computed: list[nn.Module] = []
    kept = probe.blocks[0].forward  # an instance forward another library put on a block is kept
    probe.blocks[0].forward = kept
    for layer in [0, 1, probe.n_layers - 1, probe.n_layers]:
        states = encode(model, prompts, layer).states
        padded = torch.zeros(2, 6, probe.hidden_size)
        for i, s in enumerate(states):
            padded[i, : len(s)] = s
        ran.clear()  # the blocks below the layer hand the given states on without computing (every family here)
        computed.clear()
        with contextlib.ExitStack() as stack:
            for i, block in enumerate(probe.blocks):
                stack.callback(block.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)).remove)
                for module in list(block.modules())[1:]:  # any submodule of a block that runs (projections, norms)
                    if not list(module.children()):
                        hook = module.register_forward_pre_hook(lambda m, a, b=block: computed.append(b))
                        stack.callback(hook.remove)
            out = probe.final_from(padded, layer)
        assert ran == list(range(probe.n_layers if layer < probe.n_layers else 0)), name  # each block once, in order
        below = {id(b) for b in probe.blocks[:layer]}  # ... and only those above the layer compute
        assert {id(b) for b in computed} == {id(b) for b in probe.blocks} - below, f"{name} layer {layer}"
        assert probe.blocks[0].__dict__["forward"] is kept
        for i, ids in enumerate(prompts):
            torch.testing.assert_close(out[i, : len(ids)], ref[i], rtol=1e-4, atol=1e-4, msg=f"{name} layer {layer}")


def _tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_prefix_grown_from_the_verification_keys_equals_one_grown_by_a_forward(name):
    """advance_from (the engine's prefix growth: the decided candidate's keys and values, kept from its verification
    forward) continues exactly like advance_rows (one more forward), on two prefix rows, at the first and last block,
    over a prefix longer than the tiny Mistral's and Gemma-2's sliding windows (4 tokens), and from the empty prefix
    (position 0: the cache is created from the keys)."""
    model = lminvert.load_model(name)
    probe = model.probe
    gen = torch.Generator().manual_seed(0)
    for length, layer in itertools.product((9, 0), (probe.layer(1), probe.layer(-1))):
        rows = torch.randint(0, VOCAB, (2, length), generator=gen).tolist()
        grown = probe.prefixes(rows, layer)
        kept = probe.prefixes(rows, layer)
        candidates = torch.randint(0, VOCAB, (6,), generator=gen)
        which = torch.tensor([0, 0, 0, 1, 1, 1])
        states, new = probe.continuation(kept, token_ids=candidates, rows=which, keys=True)
        chosen = torch.tensor([2, 4])  # one candidate per row
        tokens = candidates[chosen].tolist()
        kept = probe.advance_from(kept, tokens, new.take(chosen))
        grown, state = probe.advance_rows(grown, tokens)
        assert kept.rows == grown.rows
        torch.testing.assert_close(states[chosen], state, rtol=1e-5, atol=1e-5)
        after = torch.randint(0, VOCAB, (4,), generator=gen)
        on = torch.tensor([0, 1, 0, 1])
        torch.testing.assert_close(
            probe.continuation(kept, token_ids=after, rows=on),
            probe.continuation(grown, token_ids=after, rows=on),
            rtol=1e-5,
            atol=1e-5,
        )


def test_blocks_that_cannot_be_found_are_named():
    model = _tiny_gpt2()
    model.config.n_layer = 3  # no list of 3 blocks anywhere
    with pytest.raises(LminvertError, match="cannot find the 3 transformer blocks of GPT2Model") as err:
        LayerProbe(model)
    assert "\n" not in str(err.value)


def test_a_decoy_list_of_blocks_is_caught_not_read():
    """A ModuleList the probe would pick (named `layers`) that the forward never runs: an error, not wrong states."""
    model = _tiny_gpt2()
    model.transformer.layers = nn.ModuleList([nn.Identity(), nn.Identity()])
    with pytest.raises(LminvertError, match="do not run in its forward"):
        LayerProbe(model)


def test_a_wrong_list_of_blocks_is_caught_not_read():
    """A ModuleList that runs but is not the residual stream (the layer norms of each block)."""
    model = _tiny_gpt2()

    class Tap(nn.Module):  # wraps ln_1: runs once per block, outputs something other than the block's output
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    for block in model.transformer.h:
        block.ln_1 = Tap(block.ln_1)
    model.transformer.layers = nn.ModuleList([block.ln_1 for block in model.transformer.h])
    with pytest.raises(LminvertError, match=r"is not transformers' hidden_states\[0\]|hidden_states\[1\]"):
        LayerProbe(model)


def test_a_final_norm_that_cannot_be_found_is_named(monkeypatch):
    from lminvert.models import discovery as probe_module

    monkeypatch.setattr(probe_module, "NORM_NAMES", ("norm",))  # as if GPT-2 named its final norm unusually
    with pytest.raises(LminvertError, match="cannot find the final norm of GPT2LMHeadModel"):
        LayerProbe(_tiny_gpt2())


def test_a_decoy_final_norm_is_caught_not_used():
    model = _tiny_gpt2()
    model.transformer.norm = nn.LayerNorm(16)  # found before ln_f, never run by the forward
    with torch.no_grad():
        model.transformer.norm.weight.mul_(3.0)  # (a fresh LayerNorm would compute what GPT-2's fresh ln_f does)
    with pytest.raises(LminvertError, match="final norm found in GPT2LMHeadModel does not give"):
        LayerProbe(model)


@pytest.mark.parametrize("how", ["ignored", "refused"])
def test_a_forward_that_cannot_be_cut_short_is_named(how):
    """The probe runs a forward through block l only by cutting the block list for the call; a family whose forward
    ignores the cut (runs every block) or cannot run without every block is a one-line error, never a wrong state."""

    class Uncut(nn.ModuleList):
        def __getitem__(self, index):
            if isinstance(index, slice):
                if how == "refused":
                    raise IndexError("this family runs all its blocks")
                return self
            return super().__getitem__(index)

    model = _tiny_gpt2()
    model.transformer.h = Uncut(model.transformer.h)
    with pytest.raises(LminvertError, match=r"run through block 0 only does not give .*stop its forward early"):
        LayerProbe(model)


def test_wrapped_models_are_checked_too():
    loaded = LoadedModel.wrap("gpt2-tiny", _tiny_gpt2())
    assert loaded.probe.n_layers == 2 and loaded.probe.blocks_name == "h"


def _packed_and_single(probe: LayerProbe, monkeypatch) -> bool:
    """Compare packed continuations (4 tokens per packed row) with one row each on two prefix rows: one-token
    continuations and chains of 3, states and keys; whether the packed path was taken."""
    layer = probe.layer(-1)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (2, 3), generator=gen).tolist()
    prefix = probe.prefixes(rows, layer)
    taken = []
    build = probe._packing
    monkeypatch.setattr(probe, "_packing", lambda *a, **k: taken.append(build(*a, **k)) or taken[-1])
    candidates = torch.randint(0, VOCAB, (7,), generator=gen)
    which = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    chains = torch.randint(0, VOCAB, (5, 3), generator=gen)
    on = torch.tensor([1, 0, 1, 1, 0])
    lengths = [3, 1, 2, 1, 3]  # a tree: chains of different lengths (the rest of each row is padding)
    results = {}
    for pack in (4, 0):
        probe.pack = pack
        with probe.always_packed():  # short prefixes are packed only when asked (it pays from long ones)
            states, new = probe.continuation(prefix, token_ids=candidates, rows=which, keys=True)
            chained, chain_keys = probe.chains(prefix, chains, rows=on)
        ragged, ragged_keys = probe.chains(prefix, chains, rows=on, lengths=lengths)  # packed whenever it can be
        results[pack] = (states, new, chained, chain_keys)
        results[pack, "ragged"] = [(ragged[b, :n], ragged_keys.take(torch.tensor([b]))) for b, n in enumerate(lengths)]
    for (packed, packed_keys), (single, single_keys), n in zip(
        results[4, "ragged"], results[0, "ragged"], lengths, strict=True
    ):
        torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-5)
        for (pk, pv), (sk, sv) in zip(packed_keys.layers, single_keys.layers, strict=True):
            torch.testing.assert_close(pk[:, :, :n], sk[:, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pv[:, :, :n], sv[:, :, :n], rtol=1e-5, atol=1e-5)
    probe.pack = 4
    assert probe.packed_from > 0 and probe._packing(prefix, 7, 1, which) is None  # by default: not at 3 tokens
    (s4, k4, c4, ck4), (s0, k0, c0, ck0) = results[4], results[0]
    torch.testing.assert_close(s4, s0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c4, c0, rtol=1e-5, atol=1e-5)
    for packed, single in ((k4, k0), (ck4, ck0)):
        assert len(packed.layers) == len(single.layers)
        for (pk, pv), (sk, sv) in zip(packed.layers, single.layers, strict=True):
            torch.testing.assert_close(pk, sk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pv, sv, rtol=1e-5, atol=1e-5)
    return any(p is not None for p in taken)


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_continuations_equal_one_row_each(name, monkeypatch):
    """Continuations packed side by side in rows of the forward (a block-diagonal mask over the shared prefix) give
    every continuation's own states and keys: equal, to rounding, to each continuation in its own row, for one-token
    continuations and chains, on two prefix rows, with packed rows that hold fewer than ``pack`` tokens (zero-filled
    places). The packed path is taken on every family whose sliding window (tiny Mistral and Gemma-2: 4 tokens)
    does not end inside the packed row; there the probe keeps one row each."""
    probe = lminvert.load_model(name).probe
    window = getattr(probe.config, "sliding_window", None)
    assert _packed_and_single(probe, monkeypatch) == (window is None or window >= 3 + 4)


def test_packed_continuations_with_eager_attention(monkeypatch):
    """Eager attention takes the mask as additive floats: the same equality (tiny Llama switched to eager)."""
    model = lminvert.load_model("tiny-llama")
    model.model.set_attn_implementation("eager")
    assert model.model.config._attn_implementation == "eager"
    assert _packed_and_single(model.probe, monkeypatch)


@pytest.mark.parametrize("name", FAMILIES)
def test_tokens_alone_without_query_and_key_products_have_the_models_own_states_bit_for_bit(name):
    """models.single_key: a first-position table's forward (every token alone, its query and key projections giving
    zeros where they are separate modules) equals the model's own forward of each token alone at every layer, bit for
    bit; outside it the projections are the model's again, and a token after a prefix is unaffected."""
    from lminvert.forward import vocabulary_states
    from lminvert.models.single_key import single_key

    model = lminvert.load_model(name)
    probe = model.probe
    layers = probe.layers([1, probe.n_layers])
    tokens = torch.tensor([0, 5, 17, 4021, VOCAB - 1])
    ((_, states),) = vocabulary_states(model, [], layers, tokens=tokens)
    own = probe.states(tokens[:, None], layers)  # the plain forward of each token alone
    for layer in layers:
        assert torch.equal(states[layer], own[layer][:, 0].float().cpu()), (name, layer.name)

    def queries() -> list[type]:
        return [type(getattr(getattr(b, "self_attn", None), "q_proj", None)) for b in probe.blocks]

    before = queries()
    with single_key(probe.blocks):
        swapped = queries()
    assert queries() == before
    assert (swapped != before) == (before[0] is nn.Linear)  # separate projections are swapped, fused ones are not
    ((_, after),) = vocabulary_states(model, [3, 9], layers, tokens=tokens)  # after a prefix: every product runs
    full = probe.states(torch.cat([torch.tensor([[3, 9]]).expand(5, 2), tokens[:, None]], 1), layers)
    top = layers[-1]
    assert torch.allclose(
        after[top], full[top][:, -1].float().cpu(), rtol=1e-4, atol=1e-4 * float(full[top].abs().max())
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_rows_computed_from_states_are_the_models_own_cache_at_every_block(name):
    """A KV leak's rows as lminvert computes them from each position's state (keys turned at their position) equal
    transformers' own cache, at every block: on Gemma-3 the sliding and the full attention blocks turn keys with
    different bases (one rotary embedding per kind of attention)."""
    from lminvert.models.kv import kv_block

    model = lminvert.load_model(name)
    try:
        kv_block(model, 1)
    except LminvertError:
        pytest.skip(f"{name}: no Llama-style attention (the KV leak refuses it)")
    ids = [3, 17, 250, 9, 1024, 77, 5]
    for block in range(1, model.probe.n_layers + 1):
        kv = kv_block(model, block)
        states = encode(model, [ids], block - 1).states[0]
        rows = torch.cat([kv.rows(states[t : t + 1], t) for t in range(len(ids))])
        cached = kv.cached(ids)  # a sliding window's block holds its last positions only (tiny-mistral: 3 of 7)
        assert 0 < len(cached) <= len(rows) and rows.shape[1:] == cached.shape[1:]
        held = rows[len(rows) - len(cached) :]
        assert torch.allclose(held, cached, rtol=1e-4, atol=1e-5 * float(cached.abs().max())), (name, block)
