"""Chains of first guesses (speculative verification): the chain forward, the speculator's book-keeping, and the
guarantee that speculation changes speed, never the answer."""

from __future__ import annotations

import importlib

import pytest
import torch

import lminvert
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.speculation import MIN_RATE, TOKENS, TREE_RATE, Speculator

from ..conftest import TINY

IDS = [17, 4021, 3300, 17, 5, 912, 64, 64, 7, 30000, 12, 9]


@pytest.mark.parametrize("family", TINY)
def test_a_chain_states_each_position_as_a_one_token_continuation(family):
    """Position j of a chain is the state of its token after the prefix grown by the chain's first j tokens, and its
    keys and values grow a prefix that verifies later tokens as a forward-grown one does."""
    model = lminvert.load_model(family)
    probe = model.probe
    layer = probe.layer(2)
    prefix = probe.prefix(IDS[:3], layer)
    states, new = probe.chains(prefix, torch.tensor([IDS[3:8], IDS[6:11]]), rows=None)
    assert states.shape == (2, 5, probe.hidden_size) and new is not None
    for j in range(5):
        one = probe.continuation(probe.prefix(IDS[:3] + IDS[3 : 3 + j], layer), token_ids=torch.tensor([IDS[3 + j]]))
        torch.testing.assert_close(states[0, j], one[0], rtol=1e-4, atol=1e-5)
    grown = probe.prefix(IDS[:3], layer)
    for j in range(3):
        grown = probe.advance_from(grown, [IDS[3 + j]], new.take(torch.tensor([0])).at(j))
    reference = probe.prefix(IDS[:6], layer)
    later = torch.tensor([IDS[6], 100, 20000])
    torch.testing.assert_close(
        probe.continuation(grown, token_ids=later), probe.continuation(reference, token_ids=later), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        probe.chains(prefix, torch.tensor(IDS[3:8]))
    with pytest.raises(ValueError, match="one length"):
        probe.chains(prefix, torch.tensor([IDS[3:8]]), lengths=[6])


def test_the_speculator_follows_the_decided_chain_only():
    firsts = [[t, t + 1] for t in range(100, 120)]  # position t: the sources guess 99 + t and 100 + t
    spec = Speculator(firsts)
    assert spec.tail(0, 20, 1) is None  # position 0 is the table's
    assert spec.tail(3, 20, 1) is None  # no guess has been right yet
    spec.decided(1, 100)  # the first source's guess was right at position 1
    tail = spec.tail(3, 20, 2)
    assert tail is not None and tail[:2] == [103, 104] and 2 * (1 + len(tail)) <= TOKENS
    states = torch.arange(2 * len(tail) * 3, dtype=torch.float32).reshape(2, len(tail), 3)
    asked = []
    spec.store([7, 8], tail, states, lambda i: asked.append(i) or [None] * len(tail))
    spec.decided(3, 8)  # the second root was the token: its chain's states are the next positions' first candidates
    assert asked == [1]  # the keys of the decided root's chain only are taken from the verification batch
    (token, state, _), plain = spec.take()
    assert token == 103 and torch.equal(state, states[1, 0]) and plain is None
    spec.decided(4, 103)
    assert spec.take()[0][0] == 104
    spec.decided(5, 555)  # the chain guessed wrong here: the rest followed another prefix
    assert spec.take() == (None, None)
    for position in range(6, 9):  # neither source right: no more chains
        spec.decided(position, -1)
    assert max(spec.rates) < MIN_RATE and spec.tail(9, 20, 1) is None


def test_in_a_tree_the_candidates_a_source_guessed_carry_the_chain():
    """Where chains of different lengths are packed (a tree), the chain follows the candidates some source guessed
    first at the position (the better source's first), not every candidate; with no such candidate, the first one."""
    firsts = [[t, t + 1] for t in range(100, 120)]  # position t: the sources guess 99 + t and 100 + t
    spec = Speculator(firsts)
    assert spec.tail(3, 20, 1) is None and spec.tail(3, 20, 1, tree=True) is not None  # a tree chains sooner
    spec.decided(1, 101)  # the second source was right: it ranks first now
    assert spec.roots(3, [5, 102, 103, 6]) == [2, 1]
    assert spec.roots(3, [5, 102]) == [1]
    assert spec.roots(3, [5, 6]) == [0]
    assert spec.roots(0, [5, 6]) == [0]  # position 0: no guesses
    for position in range(4, 9):  # neither source right: no more chains, not even in a tree
        spec.decided(position, -1)
    assert max(spec.rates) < TREE_RATE and spec.tail(9, 20, 1, tree=True) is None


def test_the_speculator_keeps_the_plain_states_of_the_confirmed_token_only():
    """A confirmation's plain forward is filled with the better source's first guesses up to the observed length;
    their states become the next positions' first candidates if the confirmed contender is the position's token."""
    firsts = [[t, t + 1] for t in range(100, 120)]  # position t: the sources guess 99 + t and 100 + t
    spec = Speculator(firsts)
    assert spec.fill(19, 20) == [] and spec.fill(16, 20) == [116, 117, 118]  # the first source while none was right
    spec.decided(1, 101)  # the second source was right
    fill = spec.fill(16, 20)
    assert fill == [117, 118, 119]
    states = torch.arange(2 * len(fill) * 3, dtype=torch.float32).reshape(2, len(fill), 3)
    spec.store_plain(7, fill, states[0])
    spec.store_plain(8, fill, states[1])
    spec.decided(16, 8)
    chained, (token, state, keys) = spec.take()
    assert chained is None and token == 117 and torch.equal(state, states[1, 0]) and keys is None
    spec.decided(17, 117)
    assert spec.take()[1][0] == 118
    spec.decided(18, 5)  # a wrong guess: the rest is dropped
    assert spec.take() == (None, None)
    spec.store_plain(7, fill, states[0])
    spec.decided(16, 9)  # no confirmed contender was the token
    assert spec.take() == (None, None)


def _replace_prior(monkeypatch, ids, guesses: str):
    """The next-token prior's orders and first guesses replaced: the true token first at every position (``right``),
    at none (``wrong``), or at all but every sixth (``mixed``: chains run into wrong guesses)."""
    proposal = importlib.import_module("lminvert.invert.proposal")
    vocab = 49152

    def guess(t):
        right = guesses == "right" or (guesses == "mixed" and t % 6)
        return ids[t] if right else (ids[t] + 1 + t) % vocab

    def orders(self, position):
        if position == 0:
            return None
        rest = torch.tensor([(ids[position] + 7 * k + 3) % vocab for k in range(1, 64)])
        return torch.cat([torch.tensor([guess(position)]), rest])[None, None].to(self._orders[0].device)

    monkeypatch.setattr(proposal.NextTokenPrior, "orders", orders)
    monkeypatch.setattr(proposal.NextTokenPrior, "firsts", lambda self, i: [[guess(t)] for t in range(1, len(ids))])


@pytest.mark.parametrize("guesses", ["right", "mixed", "wrong"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_changes_speed_never_the_answer(monkeypatch, guesses, dtype):
    """In float32 chains of cached verifications speculate; in bfloat16 (every position confirmed by a plain forward)
    the confirmations' fills as well."""
    model = lminvert.load_model("tiny-llama", dtype=dtype)
    states = encode(model, [IDS], 2)
    _replace_prior(monkeypatch, IDS, guesses)
    (on,) = invert(model, states, scout=False)  # the chains alone (the scout's whole-prompt guess: test_scout.py)
    (off,) = invert(model, states, speculate=False)
    assert on.token_ids == off.token_ids == IDS
    assert on.uncertain_positions == off.uncertain_positions == []
    speculated = sum(p.speculated for p in on.positions)
    assert not any(p.speculated for p in off.positions)
    if guesses == "right":  # once the guesses have proved right, chains decide most positions without a forward
        assert speculated >= len(IDS) // 2
        assert on.forwards < off.forwards
    elif guesses == "mixed":  # chains ran into wrong guesses: those positions were searched as usual
        assert 0 < speculated < len(IDS) - len(IDS) // 6
    else:
        assert speculated == 0


def test_no_chains_where_they_cannot_reproduce_the_observer():
    """Chains on a CPU in every dtype and in float32 anywhere; not for a half-precision model on a GPU, whose kernels
    round a chain's rows unlike the observer's forward (on an H100 a bfloat16 SmolLM2 prompt otherwise left every
    position after the first chain uncertain)."""
    from types import SimpleNamespace

    from lminvert.invert.speculation import chains_reproduce

    def probe(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert all(chains_reproduce(probe("cpu", d)) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert chains_reproduce(probe("cuda", torch.float32))
    assert not chains_reproduce(probe("cuda", torch.bfloat16)) and not chains_reproduce(probe("cuda", torch.float16))
    assert not chains_reproduce(probe("mps", torch.float16))
