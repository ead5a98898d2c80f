"""The real default model in bfloat16 and float16: exact inversion, nothing wrong without a flag, dtype-bound files."""

from __future__ import annotations

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
        assert all(p.margin > 2 * p.tolerance for p in r.positions[1:])  # position 0: the sink (confirmed)
    with pytest.raises(LminvertError, match=f"--dtype {dtype}"):
        invert(smollm2, states)
