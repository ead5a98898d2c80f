"""Gemma-3-270M (optional: `make setup-gemma`): 262k vocabulary, embeddings scaled by sqrt(d) in the module."""

from __future__ import annotations

import math

import pytest
import torch

from lminvert.models import REGISTRY, sources

pytestmark = pytest.mark.skipif(
    not sources.is_available(REGISTRY["gemma3-270m"]), reason="gemma3-270m not installed (make setup-gemma)"
)


def test_gemma_probe_uses_scaled_embeddings():
    import lminvert

    model = lminvert.load_model("gemma3-270m")
    probe = model.probe
    assert probe.vocab_size == 262144 and probe.n_layers == 18
    ids = torch.tensor([model.tokenize("The injectivity of language models")])
    with torch.no_grad():
        ref = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    ours = probe.states(ids, [0, 9, "final"])
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[9], ref[9], rtol=0, atol=0)
    raw = model.model.get_input_embeddings().weight[ids]
    torch.testing.assert_close(ours[0], raw * math.sqrt(probe.hidden_size), rtol=1e-2, atol=1e-3)
    prefix = probe.prefix(ids[0, :4].tolist(), 9)
    got = probe.continuation(prefix, token_ids=ids[0, 4:5])
    assert (got[0] - ours[9][0, 4]).norm() <= 1e-5 * ours[9][0, 4].norm()
