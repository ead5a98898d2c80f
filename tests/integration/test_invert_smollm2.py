"""Exact inversion on the real default model (SmolLM2-135M), including its attention-sink first position."""

from __future__ import annotations

import pytest
import torch

from lminvert.forward import encode
from lminvert.invert import invert

LAYER = 6  # a middle-depth layer whose first-position table builds in seconds on a CPU


def test_exact_on_text_and_random_ids(smollm2):
    text = smollm2.tokenize("Contact Jane Doe at jane.doe@example.com or +1 555 0100 about invoice 4471.")[:14]
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(0, smollm2.probe.vocab_size, (8,), generator=gen).tolist()
    states = encode(smollm2, [text, rand], LAYER)
    results = invert(smollm2, states)
    assert [r.token_ids for r in results] == [text, rand]
    for r in results:
        assert r.uncertain_positions == []
        # decisive: the nearest rejected candidate is orders of magnitude farther than the accepted one
        assert all(m > 1e3 * max(d, 1e-6) for m, d in zip(r.margins[1:], r.distances[1:], strict=True))
        assert r.explored_fraction < 0.02


def test_cached_verification_matches_full_forward_states(smollm2):
    """The accepted distance (cached batched forward vs. plain full forward) stays inside the tolerance."""
    ids = smollm2.tokenize("def add(a, b):\n    return a + b\n")
    (result,) = invert(smollm2, encode(smollm2, [ids], LAYER))
    assert result.token_ids == ids
    assert all(p.distance <= p.tolerance for p in result.positions)


def test_carried_offset_ranks_random_ids_and_never_changes_the_answer(smollm2, monkeypatch):
    """Where the next-token prior fails (random ids), the first batch holds the secant ranking's top few with the
    offset carried from the previous position: it finds tokens at once somewhere, and the answer is the same without
    it. (With the linear reading map: a reading network cached for the layer reads random ids at once, and the
    rankings tested here would not be needed.)"""
    from lminvert.invert import reader
    from lminvert.invert.engine import invert_prompts

    monkeypatch.setattr(reader, "load_reader", lambda model, layer: None)
    from lminvert.invert.policies import LinearPolicy

    class Recorded(LinearPolicy):
        def accepted(self, position: int, token_id: int) -> None:
            if self._carried_order is not None:  # its first entries (a partial sort): beyond them, their number
                found = (self._carried_order == token_id).nonzero()
                self.ranks.append(int(found[0, 0]) if len(found) else len(self._carried_order))
            super().accepted(position, token_id)

    gen = torch.Generator().manual_seed(2)
    rand = torch.randint(0, smollm2.probe.vocab_size, (12,), generator=gen).tolist()
    (observed,) = encode(smollm2, [rand], LAYER).states
    results, ranks = [], []
    for carried in (16, 0):
        policy = Recorded(carried=carried)
        policy.ranks = []
        results += invert_prompts(smollm2, [observed], LAYER, policies=[policy])
        ranks.append(policy.ranks)
    assert [r.token_ids for r in results] == [rand, rand]
    assert all(r.uncertain_positions == [] for r in results)
    assert any(rank < 16 for rank in ranks[0])  # the carried ranking had the token in its top 16 somewhere
    assert ranks[1] == []  # carried=0: never ranked


def test_a_long_prompt_is_exact_with_its_candidates_packed_over_the_prefix(smollm2, monkeypatch):
    """Past ``pack`` tokens of prefix, the candidates of a position share one row of the verification forward (a
    block-diagonal mask over the prefix's keys and values, read once instead of copied per candidate): every position
    of a 90-token prompt is still recovered exactly and inside its radius, and the packed path did run."""
    probe = smollm2.probe
    monkeypatch.setattr(probe, "packed_from", 1)  # pack every batch past `pack` tokens, however small
    packed = []  # prefix lengths of forwards of one-token candidates that ran packed
    build = probe._packing

    def spy(prefix, batch, tokens, rows, lengths=None):
        found = build(prefix, batch, tokens, rows, lengths)
        if found is not None and lengths is None and tokens == 1:
            packed.append(prefix.length)
        return found

    monkeypatch.setattr(probe, "_packing", spy)
    text = (
        "The committee met on Tuesday to review the budget for the coming year. After a long discussion about "
        "maintenance costs, the members agreed to postpone the new library wing and to repair the roof of the town "
        "hall first. The mayor thanked the volunteers who counted the ballots and promised a public report by March. "
        "Several residents asked why the bus line to the hospital had been cut, and the transport officer explained "
        "that the grant which paid for it had ended in the autumn and would not be renewed."
    )
    ids = smollm2.tokenize(text)[:90]
    assert len(ids) == 90
    # without chains every position verifies its own candidates (chains run packed too: test_families, test_speculation)
    (result,) = invert(smollm2, encode(smollm2, [ids], LAYER), speculate=False)
    assert result.token_ids == ids
    assert result.uncertain_positions == []
    assert all(p.distance <= p.tolerance for p in result.positions)
    assert sum(length >= 64 for length in packed) >= 10  # positions past the 64th verified in packed rows


def test_a_positions_own_fit_ranks_its_later_batches_and_never_changes_the_answer(smollm2, monkeypatch):
    """Where the fit pooled over the last positions keeps missing (random ids), a fit on the position's own pairs
    ranks half of each later batch (``local_from``): it runs, and the answer is the same without it. (With the
    linear reading map, as above.)"""
    from lminvert.invert import reader
    from lminvert.invert.engine import invert_prompts

    monkeypatch.setattr(reader, "load_reader", lambda model, layer: None)
    from lminvert.invert.policies import LinearPolicy

    def recorded(policy: LinearPolicy) -> list[bool]:
        fits: list[bool] = []
        fit = policy.secant.fit

        def recording(ctx) -> None:  # after each refit: did the position's own fit (the local ranker's) run?
            fit(ctx)
            fits.append(policy.secant.local is not None)

        policy.secant.fit = recording
        return fits

    gen = torch.Generator().manual_seed(2)
    rand = torch.randint(0, smollm2.probe.vocab_size, (12,), generator=gen).tolist()
    (observed,) = encode(smollm2, [rand], LAYER).states
    results, fits = [], []
    for local_from in (16, 0):
        policy = LinearPolicy(local_from=local_from, carried=0)  # carried=0: a worse first batch, more refits
        fits.append(recorded(policy))
        results += invert_prompts(smollm2, [observed], LAYER, policies=[policy])
    assert [r.token_ids for r in results] == [rand, rand]
    assert all(r.uncertain_positions == [] for r in results)
    assert any(fits[0]) and not any(fits[1])


def test_position_0_at_a_layer_without_its_own_table_is_ranked_with_a_kept_table_above(smollm2, monkeypatch):
    """Layer 5 has no first-position table of its own: position 0 is ranked with layer 6's (its observed state lifted
    there through block 6), verified at layer 5 and certified, and no forward of the whole vocabulary runs."""
    from lminvert.invert import tables

    below, above = smollm2.probe.layer(LAYER - 1), smollm2.probe.layer(LAYER)
    if tables.kept(smollm2, below, "table") is not None:
        pytest.skip("this cache holds layer 5's own table")
    tables.first_position_table(smollm2, above, progress=False)  # this module's layer: built once, kept
    read = []
    real = tables.first_position_table
    monkeypatch.setattr(
        tables, "first_position_table", lambda m, layer, **kw: read.append(layer) or real(m, layer, **kw)
    )
    ids = smollm2.tokenize("The ferry to the northern islands leaves twice a day.")
    (result,) = invert(smollm2, encode(smollm2, [ids], below))
    assert result.token_ids == ids and set(result.verdicts) == {"certified"}
    assert result.positions[0].candidates_checked <= 8  # the lifted state is nearest its own token's row
    # only layer 6's kept table is read (again by the sink ranker, where a later position is a sink: from memory)
    assert read and set(read) == {above} and tables.kept(smollm2, below, "table") is None


def test_one_vector_gives_back_a_short_prompt_certified_and_claims_nothing_longer(smollm2):
    """``leak="last"`` on SmolLM2's layer 1: a two-token prompt from its last state alone, raw and normalised, is
    certified (reproduced bit for bit); a five-token prompt, longer than the search tries, is uncertain."""
    short = smollm2.tokenize("Hello world")
    longer = smollm2.tokenize("The ferry leaves twice daily")[:5]
    vectors = [encode(smollm2, [ids], 1).states[0][-1].float() for ids in (short, longer)]
    for normalised in (False, True):
        vector = vectors[0] / vectors[0].norm() if normalised else vectors[0]
        (result,) = invert(smollm2, vector, 1, leak="last", normalised=normalised, max_seconds=30, max_length=3)
        assert result.token_ids == short and set(result.verdicts) == {"certified"}, (normalised, result.text)
    (result,) = invert(smollm2, vectors[1], 1, leak="last", max_seconds=10, max_length=3)
    assert len(result.token_ids) <= 3 and set(result.verdicts) == {"uncertain"}


def test_one_vector_after_the_first_block_gives_back_an_eight_token_prompt_certified(smollm2):
    """``leak="last"`` at layer 1: an eight-token prompt from its last state alone, by the first block's algebra
    (:mod:`lminvert.invert.firstblock`), certified; the same vector told the prompts are at most 4 tokens long claims
    nothing."""
    ids = smollm2.tokenize("The lighthouse keeper wrote to his sister every Sunday evening.")[:8]
    vector = encode(smollm2, [ids], 1).states[0][-1].float()
    (result,) = invert(smollm2, vector, 1, leak="last", max_seconds=60)
    assert result.token_ids == ids and set(result.verdicts) == {"certified"}, result.text
    (result,) = invert(smollm2, vector, 1, leak="last", max_seconds=10, max_length=4)
    assert set(result.verdicts) == {"uncertain"}, result.text


def test_one_vector_from_a_padded_batch_is_confident_where_right_and_claims_nothing_longer(smollm2):
    """Last states computed elsewhere (a right-padded batch: not lminvert's forward bit for bit, given as ``float``):
    one- and two-token prompts come back ``confident`` (within the measured bound, far under the calibrated gap
    between two prompts' last states); a six-token prompt, longer than the search tries, is uncertain."""
    from lminvert.invert.layouts import padded_states

    prompts = [smollm2.tokenize("Hello"), smollm2.tokenize("Hello world"), smollm2.tokenize("The ferry leaves twice")]
    batch = padded_states(smollm2.probe, smollm2.probe.layer(1), [*prompts, list(range(100, 110))], "right")
    own = encode(smollm2, [prompts[1]], 1).states[0][-1].float()
    assert not torch.equal(batch[1][-1], own)  # another computation's rounding: no forward reproduces it
    for ids, rows in zip(prompts, batch, strict=False):
        (result,) = invert(smollm2, rows[-1], 1, leak="last", source="float", max_seconds=15, max_length=2)
        if len(ids) <= 2:
            assert result.token_ids == ids and set(result.verdicts) == {"confident"}, (ids, result.verdicts)
        else:
            assert set(result.verdicts) == {"uncertain"}, result.text


def test_a_second_attention_sink_is_led_by_the_first_position_table(smollm2, monkeypatch):
    """Position 1 of this random-id prompt is an attention sink at layer 6 (its norm over 4 times the later ones'):
    its state, lifted, points where its token's first-position row points (:mod:`lminvert.invert.sinks`), so the
    true token leads the position's first batch. Without the lead the engine verified 18,032 candidates there (22 s on
    this project's CPU); with it, one batch."""
    from lminvert.invert import sinks

    ids = [7724, 48536, 10287, 21288, 18139, 41558]
    states = encode(smollm2, [ids], LAYER)
    assert sinks.sinks(states.states[0]) == [1]
    result = invert(smollm2, states)[0]
    assert result.token_ids == ids and result.uncertain_positions == []
    assert result.positions[1].candidates_checked <= 16
    monkeypatch.setattr(sinks, "SINK_LEAD", False)  # off: the ranker has no table, so nothing leads
    ranker = sinks.SinkRanker()
    ranker.prepare(smollm2, smollm2.probe.layer(LAYER), True, None)
    ranker.begin_prompt(states.states[0], None)
    assert ranker.at is None and ranker.table is None and ranker._orders == {}


def test_a_position_whose_cached_state_lies_outside_the_radius_is_reproduced_and_certified(smollm2):
    """'Patient John Doe,' without a BOS token, layer 15: the true token's cached state at position 1 lies 0.21 from
    the observation, 29 times the calibrated radius, and its screened state 88.6 away, while every other token lies 79
    or more away. Before the acceptor re-measured such a standout, the search swept the vocabulary, kept a wrong
    token (uncertain) and every later position fitted nothing (120 s for 4 tokens; the whole sentence 344 s)."""
    ids = [37654, 2322, 3315, 85]
    (result,) = invert(smollm2, encode(smollm2, [ids], 15))
    assert result.token_ids == ids
    assert [p.verdict for p in result.positions] == ["certified"] * 4
    assert result.positions[1].distance > result.positions[1].tolerance  # the case: outside the radius, reproduced
