"""The block a KV cache comes from, found from its rows (:mod:`lminvert.invert.blockfit`)."""

from __future__ import annotations

import pytest
import torch

import lminvert
from lminvert.errors import LminvertError
from lminvert.invert.blockfit import resolve_block
from lminvert.invert.sources import Float
from lminvert.models.kv import kv_block


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
def test_a_block_is_never_named_wrong_and_random_rows_fit_none(family):
    """The real model's blocks are each found (tests/integration/test_leaks_smollm2.py and docs/results.md)."""
    model = lminvert.load_model(family)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.probe.vocab_size, (12,), generator=gen).tolist() for _ in range(2)]
    for block in range(1, model.probe.n_layers + 1):  # a random model's blocks look alike: named right, or refused
        rows = [kv_block(model, block).cached(ids) for ids in prompts]
        try:
            found, fit = resolve_block(model, rows, Float())
        except LminvertError as exc:
            assert str(exc).startswith(f"cannot tell which block of {family}") and "pass --layer" in str(exc)
            continue
        assert int(found) == block and fit.decisive and fit.describe().startswith(f"block {block} ")
    noise = [torch.randn(12, rows[0].shape[1], generator=gen) * 50 for _ in prompts]
    with pytest.raises(LminvertError, match="fit no block") as caught:
        resolve_block(model, noise, Float())
    assert "\n" not in str(caught.value)
