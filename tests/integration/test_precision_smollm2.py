"""The real default model in bfloat16 and float16: exact inversion, nothing wrong without a flag, dtype-bound files."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.tolerance import calibrate

LAYER = 6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_smollm2_is_exact(dtype, smollm2):
    model = lminvert.load_model("smollm2-135m", dtype=dtype)
    text = model.tokenize("Contact Jane Doe at jane.doe@example.com about invoice 4471.")[:10]
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(0, model.probe.vocab_size, (6,), generator=gen).tolist()
    states = encode(model, [text, rand], LAYER)
    results = invert(model, states)
    assert [r.token_ids for r in results] == [text, rand]
    assert all(r.uncertain_positions == [] and r.dtype == dtype for r in results)
    # the measured radius is far wider than float32's, yet far below the distance to other tokens
    half, full = calibrate(model, model.probe.layer(LAYER)), calibrate(smollm2, smollm2.probe.layer(LAYER))
    assert half.cached > 100 * full.cached
    for r in results:
        # position 0: the sink (confirmed); on a CPU with AMX bfloat16 GEMMs the random-id prompt's nearest rejected
        # candidates lie 1.7-2x the radius away, on AVX512-BF16 more than 2x
        assert all(p.margin > p.tolerance for p in r.positions[1:])
    with pytest.raises(LminvertError, match=f"--dtype {dtype}"):
        invert(smollm2, states)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_confirmation_forward_reproduces_the_observed_states_bit_for_bit(dtype):
    """The plain forward that confirms a candidate is shaped like the observer's (the whole observed length): on the
    same device and dtype it recomputes each true token's state exactly, which is what makes a half-precision match
    decisive where the acceptance radius is wider than the gaps between tokens."""
    from lminvert.invert.verification import plain_states

    model = lminvert.load_model("smollm2-135m", dtype=dtype)
    probe = model.probe
    text = model.tokenize("The quick brown fox jumps over the lazy dog near the river bank today.")[:12]
    layer = probe.layer(LAYER)
    (observed,) = encode(model, [text], LAYER).states
    prefix = probe.prefixes([[]], layer)
    kept = None
    for t, token in enumerate(text):
        asked = SimpleNamespace(
            to_confirm=[token, (token + 1) % probe.vocab_size], length=len(text), speculator=None, plain_keys=kept
        )
        again = plain_states(probe, layer, prefix, 0, asked)
        assert torch.equal(again[0], observed[t])
        assert not torch.equal(again[1], observed[t])
        kept = asked.plain_keys  # the next confirmation starts from these (the first contender's: the true token)
        assert kept is not None and list(kept.tokens[: t + 1]) == text[: t + 1]
        prefix, _ = probe.advance_rows(prefix, [token])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_plain_forwards_start_from_kept_keys_with_the_same_bits(dtype, monkeypatch):
    """A confirmation's plain forward recomputed from the keys and values an earlier one kept for the prefix, only the
    rows from there on, attention at the observed length: on this CPU in half precision the same bits as the whole
    forward at every position (so the shortcut is taken); in float32 the GEMMs round by the number of rows, and the
    whole sequence runs. A shortcut that does not reproduce the whole forward is turned off at its first use."""
    from lminvert.models import observed

    model = lminvert.load_model("smollm2-135m", dtype=dtype)
    probe = model.probe
    text = model.tokenize("The quick brown fox jumps over the lazy dog near the river bank today, said Jane Doe.")[:20]
    layer = probe.layer(LAYER)
    (whole,) = probe.states(torch.tensor([text]), [layer])[layer]
    kept = None
    for t in range(len(text)):
        rows = probe.plain_states([text], layer, upto=t, kept=kept, stop=t + 3)
        if dtype == "float32" or probe._observed.works is False:
            assert rows.start == 0 and rows.keys_of(0) is None
        else:
            # the keys kept by the last forward hold the whole prefix (the last position: one row more, MIN_ROWS)
            assert rows.start == min(t, len(text) - 2)
        stop = min(t + 3, len(text)) if rows.start or (t == 0 and dtype != "float32") else len(text)
        assert torch.equal(rows.states[0], whole[rows.start : stop])  # whichever path ran: the whole forward's bits
        kept = rows.keys_of(0)
    if dtype == "float32":
        assert probe._observed.works is False
        return
    # in half precision the shortcut is taken where it reproduces the whole forward (bfloat16 on the CPUs this project
    # has run on; float16 on AVX512 but not on a CPU with AMX float16 GEMMs, where the checks turn it off)
    assert probe._observed.works is not None
    if dtype == "bfloat16":
        assert probe._observed.works is True
    # attention at the unpadded shape (what a cached forward does) changes the bits: the check turns the shortcut off
    fresh = lminvert.load_model("smollm2-135m", dtype=dtype).probe
    unpadded = SimpleNamespace(set=lambda n: None, reset=lambda token: None, get=lambda: 0)
    monkeypatch.setattr(observed, "_LENGTH", unpadded)
    kept = fresh.plain_states([text], layer).keys_of(0)
    later = fresh.plain_states([text], layer, upto=5, kept=kept, stop=6)
    assert fresh._observed.works is False
    assert later.start == 0 and torch.equal(later.states[0], whole)


# a random-id prompt whose position 1 is an attention sink at layer 30 (its state's norm over 3 times the median after
# position 0, :data:`lminvert.invert.sinks.SHAPE_RATIO`: 7.7 times in bfloat16)
SINK_PROMPT = [
    2358, 16532, 44852, 47874, 44192, 11155, 6293, 17811, 23691, 48598, 1013, 16459, 4097, 19090, 5400, 10652, 24587,
    40232, 33612,
]  # fmt: skip


def test_a_sinks_cached_forward_at_the_observers_shape_reproduces_its_state(monkeypatch):
    """A cached forward of the true token at a sink (one query over the prefix's keys, as transformers runs it) rounds
    the sink's attention otherwise than the observer's forward of the whole prompt (SmolLM2 layer 30 in bfloat16, this
    project's CPU: 69% of the state's norm off on one such prompt), so the true token came among the last of thousands
    of contenders re-measured. At the observer's shape (what the engine runs at sink-like positions,
    :func:`.sinks.shaped`) the cached state is the observer's bit for bit; states from elsewhere that a plain forward
    may reproduce (``float``) are shaped alike (at their rows' length); at a position that is not sink-like, for noisy
    states, in float32, or with a switch off, the cached forward runs as before. (Not every sink is reproduced so: of
    5 random-id prompts with a sink at position 1, 2 were at layers 15 and 30; docs/results.md.)"""
    from lminvert.invert import sinks
    from lminvert.invert.sources import Exact, Float, Noise
    from lminvert.models import observed
    from lminvert.models.hf_internals import attn_implementation

    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    probe, layer = model.probe, model.probe.layer(30)
    (states,) = probe.states(torch.tensor([SINK_PROMPT]), [layer])[layer]
    assert sinks.sinks(states, sinks.SHAPE_RATIO) == [1]
    prefix = probe.prefixes([SINK_PROMPT[:1]], layer)
    token = torch.tensor([SINK_PROMPT[1]])
    unshaped = probe.continuation(prefix, token)[0]
    with sinks.shaped(probe, [states], 1, Exact()):
        assert attn_implementation(probe.model.config) == observed.SHAPED_ATTENTION
        at_shape = probe.continuation(prefix, token)[0]
    assert torch.equal(at_shape, states[1])
    assert (unshaped - states[1]).float().norm() >= (at_shape - states[1]).float().norm()
    with sinks.shaped(probe, [states], 1, Float()):
        assert torch.equal(probe.continuation(prefix, token)[0], at_shape)
    # not sink-like there; noisy states (no plain forward reproduces them); either switch off
    for where, source, switch, elsewhere in (
        (2, Exact(), True, True),
        (1, Noise(sigma=0.01), True, True),
        (1, Exact(), False, True),
        (1, Float(), True, False),
    ):
        monkeypatch.setattr(observed, "SHAPED", switch)
        monkeypatch.setattr(sinks, "SHAPE_ELSEWHERE", elsewhere)
        with sinks.shaped(probe, [states], where, source):
            assert attn_implementation(probe.model.config) == "sdpa"
            assert torch.equal(probe.continuation(prefix, token)[0], unshaped)
    monkeypatch.setattr(observed, "SHAPED", True)
    full = lminvert.load_model("smollm2-135m").probe  # float32: its GEMMs round by the number of rows
    with sinks.shaped(full, [states.float()], 1, Exact()):
        assert attn_implementation(full.model.config) == "sdpa"


def test_confirmations_filled_with_first_guesses_save_forwards_never_change_the_answer(monkeypatch):
    """Where the ball is wider than the smallest gap between tokens' states, every position is confirmed by a plain
    forward of the observed length (bfloat16 at most layers from 3 on; here layer 6, the radii widened past the gap if
    they are not, as ``tolerance_scale`` does for states from other hardware). That forward filled with the next
    positions' first guesses (not copies of the contender) decides right guesses there without a verification or
    confirmation of their own. The same ids and no flags with the fill, with copies, and without speculation."""
    from lminvert.invert.speculation import Speculator
    from lminvert.invert.tolerance import SAFETY

    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    text = model.tokenize("The quick brown fox jumps over the lazy dog near the river bank today.")[:14]
    states = encode(model, [text], LAYER)
    measured = calibrate(model, model.probe.layer(LAYER))
    # the ball at least twice the gap: widened where the measured radius alone is narrower (with the calibration's
    # nearest input vectors among its candidates, layer 6's measured ball is already 2.7 times its gap)
    wide = max(1.0, 2 * measured.gap / (SAFETY * measured.cached))
    (filled,) = invert(model, states, tolerance_scale=wide)
    (off,) = invert(model, states, tolerance_scale=wide, speculate=False)
    monkeypatch.setattr(Speculator, "fill", lambda self, position, length: [])
    (copies,) = invert(model, states, tolerance_scale=wide)
    assert filled.token_ids == copies.token_ids == off.token_ids == text
    assert filled.uncertain_positions == copies.uncertain_positions == off.uncertain_positions == []
    assert all(p.plain_distance == 0.0 for p in filled.positions)  # each reproduced the observation bit for bit
    by_fill = [p for p in filled.positions if p.speculated and p.candidates_checked == 1]
    assert by_fill and all(p.forwards <= 1 for p in by_fill)  # at most the prefix's extension
    assert filled.forwards < copies.forwards


def test_encoded_states_are_what_each_prompt_gives_alone():
    """Prompts of different lengths encoded together: each prompt's bfloat16 states equal its states encoded alone
    (a padded batch would round differently, and the inversion could not reproduce the observation exactly)."""
    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    short = model.tokenize("The quick brown fox jumps over the lazy dog.")
    long = model.tokenize("Contact Jane Doe at jane.doe@example.com about invoice 4471 before Friday, please.")
    together = encode(model, [long, short, short[:4], long], LAYER).states
    for ids, state in zip([long, short, short[:4], long], together, strict=True):
        assert torch.equal(state, encode(model, [ids], LAYER).states[0])
