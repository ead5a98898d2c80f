"""The real default model's states as a deployment captures them: a padded bfloat16 transformers batch."""

from __future__ import annotations

import lminvert
from lminvert.invert import acceptor, invert
from lminvert.states import HiddenStates

from ..unit.test_foreign import padded_capture

LAYER = 6  # the layer the precision tests build bfloat16 tables and calibrations for


def test_a_padded_bfloat16_batch_from_transformers_inverts_with_verdicts(monkeypatch):
    """The engine's verdicts on a padded bfloat16 capture, a sink-like position left a guess (the retry of such a prompt
    by the rows search, ``leaks.SINK_RETRY``, is off here and in the test below: its one-time calibrations at this layer
    in bfloat16 cost 5-6 minutes of a cold ``make test``; it is measured by ``benchmarks/bench_foreign.py`` and its
    logic tested in ``tests/unit/test_leaks.py``)."""
    from lminvert.invert import leaks

    monkeypatch.setattr(leaks, "SINK_RETRY", False)
    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    texts = [
        "Contact Jane Doe at jane.doe@example.com about invoice 4471.",
        "The meeting moved to Thursday at 3pm in room B.",
        "def add(a, b): return a + b",
    ]
    prompts = [model.tokenize(t) for t in texts]
    captured = padded_capture(model, prompts, LAYER, "right")
    assert any(len(p) < max(map(len, prompts)) for p in prompts)  # padding really happened
    results = invert(model, HiddenStates.from_array(captured), LAYER)
    verdicts = [v for r in results for v in r.verdicts]
    assert [r.token_ids for r in results] == prompts
    assert {r.source for r in results} == {"float"}
    # sure, but from a sink-like position that was not reproduced on (its own row does not choose there: every later
    # position was found given it): here the second prompt's from its seventh position
    unsure = [_after_fragile(r) for r in results]
    sure = sum(v in (acceptor.CERTIFIED, acceptor.CONFIDENT) for v in verdicts)
    assert sure + sum(unsure) == len(verdicts), [(r.verdicts, [p.reason for p in r.positions]) for r in results]
    assert sure >= 0.8 * len(verdicts)


def _after_fragile(result) -> int:
    """Positions from the first one uncertain because it is sink-like and not reproduced."""
    reasons = [p.reason for p in result.positions]
    return len(reasons) - reasons.index(acceptor.FRAGILE) if acceptor.FRAGILE in reasons else 0


def test_an_eager_attention_capture_of_sink_prompts_claims_nothing_wrong(monkeypatch):
    """bfloat16 states computed with transformers' eager attention (what asks for attention weights, or another
    library's attention, computes) of random-id prompts whose position 1 is an attention sink: such a state amplifies
    the kernels' rounding (relative disagreements up to 2 at layer 15, where a wrong sink token was ``confident``
    before the float bound took sink-like bands), so the sink is not chosen by its own row: nothing is claimed wrong,
    and the sink positions that are not reproduced say why (the engine alone: ``leaks.SINK_RETRY`` off, as above)."""
    import torch

    from lminvert.invert import leaks
    from lminvert.invert.layouts import padded_states
    from lminvert.models.observed import attention

    monkeypatch.setattr(leaks, "SINK_RETRY", False)
    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    layer = model.probe.layer(LAYER)
    ids = torch.randint(0, model.probe.vocab_size, (64, 6), generator=torch.Generator().manual_seed(5))
    norms = model.probe.states(ids, [layer])[layer].float().norm(dim=2)
    sinks = (norms[:, 1] > 4 * norms[:, 2:].median(dim=1).values).nonzero().flatten()[:3]
    prompts = [ids[i].tolist() for i in sinks]
    assert len(prompts) == 3
    with attention(model.probe, "eager"):
        captured = padded_states(model.probe, layer, prompts, "right")
    results = invert(model, HiddenStates.from_array(captured), LAYER)
    for r, truth in zip(results, prompts, strict=True):
        for p, token in zip(r.positions, truth, strict=True):
            assert p.token_id == token or p.verdict == acceptor.UNCERTAIN, (r.verdicts, r.token_ids, truth)
    assert any(r.positions[1].reason == acceptor.FRAGILE for r in results)
