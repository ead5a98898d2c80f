"""The real default model: weights are real, the probe matches transformers, caching is exact enough."""

from __future__ import annotations

import torch

from lminvert.models import sources


def test_weights_are_real_pretrained(smollm2):
    ids = smollm2.tokenize("Once upon a time, there was a little girl who")
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    text = smollm2.decode(out[0, len(ids) :].tolist()).lower()
    words = set(text.replace(".", " ").replace(",", " ").split())
    common = {"she", "her", "loved", "to", "play", "with", "the", "and", "a", "was", "had", "lived"}
    assert len(words & common) >= 4, f"continuation does not read as English: {text!r}"


def test_shape_and_cache(smollm2):
    probe = smollm2.probe
    assert (probe.n_layers, probe.hidden_size, probe.vocab_size) == (30, 576, 49152)
    assert smollm2.model.config.num_key_value_heads == 3 and smollm2.model.config.tie_word_embeddings
    assert sources.is_converted("smollm2-135m")


def test_probe_parity_with_transformers(smollm2):
    probe = smollm2.probe
    ids = torch.tensor([smollm2.tokenize("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids, output_hidden_states=True).hidden_states
    ours = probe.states(ids, [0, 1, 15, 29, 30, "final"])
    for layer in (0, 1, 15, 29):
        torch.testing.assert_close(ours[layer], ref[layer], rtol=0, atol=0)
    torch.testing.assert_close(ours[probe.final], ref[30], rtol=0, atol=0)
    assert (ours[30] - ref[30]).norm() > 1.0  # the un-normed residual stream is not transformers' last entry


def test_cached_continuation_tolerance(smollm2):
    probe = smollm2.probe
    ids = smollm2.tokenize("My password is hunter2 and my email is bob@example.com")
    for layer in (1, 15, 30):
        full = probe.states(torch.tensor(ids), layer)[layer][0]
        prefix = probe.prefix(ids[:6], layer)
        got = probe.continuation(prefix, token_ids=torch.tensor([ids[6]] * 3 + [ids[7]]))
        rel = ((got[:3] - full[6]).norm(dim=-1) / full[6].norm()).max()
        assert rel < 1e-5, f"layer {layer}: cached continuation off by {rel:.2e} (relative)"
        assert (got[3] - full[6]).norm() / full[6].norm() > 1e-2
