"""Many prompts at once: one verification forward per step across prompts gives what one prompt at a time gives."""

from __future__ import annotations

import json

import pytest
import torch

import lminvert
from lminvert.forward import encode
from lminvert.invert import invert

LENGTHS = (6, 3, 8, 1, 8, 5)  # different lengths: prompts leave the batch as they finish


def _prompts(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.probe.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.mark.parametrize(
    ("name", "layer", "dtype"), [("tiny-llama", 2, "float32"), ("tiny-gemma2", "final", "bfloat16")]
)
def test_together_equals_one_at_a_time(name, layer, dtype):
    model = lminvert.load_model(name, dtype=dtype)
    prompts = _prompts(model)
    states = encode(model, prompts, layer)
    one = invert(model, states, together=1)
    many = invert(model, states, together=len(prompts))
    pairs = invert(model, states, together=2)
    for a, b, c, ids in zip(one, many, pairs, prompts, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids == ids
        assert a.uncertain_positions == b.uncertain_positions == c.uncertain_positions == []
        assert a.candidates_checked == b.candidates_checked  # the same searches, only batched differently
    wall = sum(r.seconds for r in many)
    assert all(r.seconds > 0 for r in many) and wall > 0


def test_rows_of_a_batched_prefix_continue_their_own_prompt():
    model = lminvert.load_model("tiny-qwen2")
    probe = model.probe
    rows = [[5, 6, 7], [900, 901, 902], [48000, 3, 3]]
    batched = probe.prefixes(rows, 2)
    cands = torch.tensor([11, 12, 13, 11])
    which = torch.tensor([0, 1, 2, 2])
    got = probe.continuation(batched, token_ids=cands, rows=which)
    for k, (row, token) in enumerate(zip(which.tolist(), cands.tolist(), strict=True)):
        alone = probe.continuation(probe.prefix(rows[row], 2), token_ids=torch.tensor([token]))[0]
        torch.testing.assert_close(got[k], alone, rtol=1e-5, atol=1e-5)
    grown, states = probe.advance_rows(batched, [1, 2, 3])
    assert grown.rows == [[5, 6, 7, 1], [900, 901, 902, 2], [48000, 3, 3, 3]] and states.shape == (3, 64)
    kept = probe.select(grown, [2, 0])
    assert kept.rows == [[48000, 3, 3, 3], [5, 6, 7, 1]]
    got = probe.continuation(kept, token_ids=torch.tensor([8, 8]), rows=torch.tensor([0, 1]))
    full = probe.states(torch.tensor([[48000, 3, 3, 3, 8], [5, 6, 7, 1, 8]]), 2)[probe.layer(2)][:, -1]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        probe.continuation(kept, token_ids=torch.tensor([8]))


def test_cli_inverts_a_multi_prompt_file_together(cli, tmp):
    path = tmp / "s.safetensors"
    texts = ["Secret: 1234", "hi", "The password is hunter2, do not share it."]
    args = ["encode", "--model", "tiny-llama", "--layer", "1", "--out", str(path), "--json", "--device", "cpu"]
    enc = cli(*args, *[x for t in texts for x in ("--text", t)], check=True)
    truth = [p["token_ids"] for p in json.loads(enc.stdout)["prompts"]]
    together = json.loads(cli("invert", str(path), "--json", check=True).stdout)
    alone = json.loads(cli("invert", str(path), "--json", "--together", "1", check=True).stdout)
    assert [d["token_ids"] for d in together] == [d["token_ids"] for d in alone] == truth
    proc = cli("invert", str(path), "--together", "0")
    assert proc.returncode == 2 and "--together" in proc.stderr
