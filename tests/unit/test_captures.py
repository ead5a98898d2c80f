"""Captures as people save them: tensors, lists and dicts, masks and pad rows, other libraries' layer numbering."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import lminvert
from lminvert.captures import library_layer
from lminvert.errors import LminvertError
from lminvert.forward import padded_batch
from lminvert.states import HiddenStates

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _batch(side: str, positions: bool = True):
    model = lminvert.load_model("tiny-llama")
    ids, mask = padded_batch(PROMPTS, range(2), side)
    kwargs = {}
    if positions:
        from lminvert.forward import padded_positions

        kwargs["position_ids"] = padded_positions(ids, mask)
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)
    real = [out.hidden_states[1][i][mask[i].bool()] for i in range(2)]
    return out.hidden_states, mask, real


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_saved_dict_with_its_attention_mask_drops_the_pad_rows(tmp_path, side):
    hidden, mask, real = _batch(side, positions=False)
    torch.save({"hidden_states": hidden[1], "attention_mask": mask}, tmp_path / "leak.pt")
    states = HiddenStates.load(tmp_path / "leak.pt")
    assert states.lengths == [6, 3]
    torch.testing.assert_close(states.states[1], real[1], rtol=0, atol=0)
    assert any("attention mask" in n for n in states.notes)


def test_identical_pad_rows_are_dropped_without_a_mask(tmp_path):
    hidden, _, real = _batch("left")
    np.save(tmp_path / "leak.npy", hidden[1].numpy())
    states = HiddenStates.load(tmp_path / "leak.npy")
    assert states.lengths == [6, 3]
    torch.testing.assert_close(states.states[1], real[1], rtol=0, atol=0)
    assert any("identical rows" in n for n in states.notes)


def test_a_mask_file_and_its_errors(tmp_path):
    hidden, mask, _ = _batch("right", positions=False)
    np.save(tmp_path / "leak.npy", hidden[1].numpy())
    np.save(tmp_path / "mask.npy", mask.numpy())
    assert HiddenStates.load(tmp_path / "leak.npy", mask=tmp_path / "mask.npy").lengths == [6, 3]
    np.save(tmp_path / "bad.npy", mask[:, :4].numpy())
    with pytest.raises(LminvertError, match="mask has shape"):
        HiddenStates.load(tmp_path / "leak.npy", mask=tmp_path / "bad.npy")


def test_several_entries_need_a_key(tmp_path):
    hidden, _, _ = _batch("left")
    torch.save(hidden, tmp_path / "all.pt")  # output_hidden_states: one tensor per layer
    with pytest.raises(LminvertError, match="--key"):
        HiddenStates.load(tmp_path / "all.pt")
    assert HiddenStates.load(tmp_path / "all.pt", key="1").lengths == [6, 3]
    with pytest.raises(LminvertError, match="no entry 'x'"):
        HiddenStates.load(tmp_path / "all.pt", key="x")
    save_file({"blocks.0.hook_resid_post": hidden[1].contiguous()}, str(tmp_path / "tl.safetensors"))
    assert HiddenStates.load(tmp_path / "tl.safetensors").lengths == [6, 3]


def test_a_list_of_prompts(tmp_path):
    torch.save([torch.randn(4, 64), torch.randn(1, 2, 64)], tmp_path / "list.pt")
    assert HiddenStates.load(tmp_path / "list.pt").lengths == [4, 2]


def test_library_layer_numbering():
    assert library_layer("15", "hf", 30) == "15"
    assert library_layer("30", "hf", 30) == "final"  # transformers' last hidden state is after the final norm
    assert library_layer("-1", "hf", 30) == "final"
    assert library_layer("14", "nnsight", 30) == "15"  # model.model.layers[14].output
    assert library_layer("14", "tl", 30) == "15"  # blocks.14.hook_resid_post
    assert library_layer("middle", "lminvert", 30) == "middle"
    for bad, says in ((("31", "hf", 30), "0..30"), (("30", "tl", 30), "0..29"), (("x", "nnsight", 30), "integer")):
        with pytest.raises(LminvertError, match=says):
            library_layer(*bad)
