"""Exact inversion on the real default model (SmolLM2-135M), including its attention-sink first position."""

from __future__ import annotations

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
