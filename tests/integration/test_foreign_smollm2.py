"""The real default model's states as a deployment captures them: a padded bfloat16 transformers batch."""

from __future__ import annotations

import lminvert
from lminvert.invert import acceptor, invert
from lminvert.states import HiddenStates

from ..unit.test_foreign import padded_capture

LAYER = 6  # the layer the precision tests build bfloat16 tables and calibrations for


def test_a_padded_bfloat16_batch_from_transformers_inverts_with_verdicts():
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
    sure = sum(v in (acceptor.CERTIFIED, acceptor.CONFIDENT) for v in verdicts)
    assert sure >= 0.95 * len(verdicts), [r.verdicts for r in results]
