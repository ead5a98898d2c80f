"""States files: round trip, metadata, and one-line errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.models.compat import check_compatible
from lminvert.states import HiddenStates


@pytest.fixture(scope="module")
def llama():
    return lminvert.load_model("tiny-llama")


def test_round_trip(tmp, llama):
    states = encode(llama, [[5, 6, 7], [9, 10]], layer=1, keep_ids=True)
    path = states.save(tmp / "s.safetensors")
    back = HiddenStates.load(path)
    assert back.lengths == [3, 2]
    assert back.token_ids == ((5, 6, 7), (9, 10))
    assert back.layer == "1" and back.model == "tiny-llama" and back.weights_hash == llama.weights_hash
    for a, b in zip(states.states, back.states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert check_compatible(back, llama, None) == 1


def test_ids_not_stored_by_default(tmp, llama):
    path = encode(llama, [[5, 6, 7]], layer=1).save(tmp / "s.safetensors")
    assert HiddenStates.load(path).token_ids is None


def test_batched_encode_equals_single(llama):
    both = encode(llama, [[5, 6, 7, 8, 9], [11, 12]], layer=2)
    single = encode(llama, [[11, 12]], layer=2)
    torch.testing.assert_close(both.states[1], single.states[0], rtol=1e-5, atol=1e-5)


def test_plain_arrays(tmp):
    arr = np.random.default_rng(0).standard_normal((2, 4, 64)).astype(np.float32)
    np.save(tmp / "a.npy", arr)
    torch.save(torch.from_numpy(arr[0]), tmp / "a.pt")
    assert HiddenStates.load(tmp / "a.npy").lengths == [4, 4]
    assert HiddenStates.load(tmp / "a.pt").lengths == [4]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: np.save(p / "x.npy", np.full((3, 64), np.nan, np.float32)), "NaN"),
        (lambda p: np.save(p / "x.npy", np.zeros((0, 64), np.float32)), "empty|T >= 1"),
        (lambda p: np.save(p / "x.npy", np.zeros((2, 3, 4, 5), np.float32)), "shape"),
        (lambda p: (p / "x.safetensors").write_bytes(b"not a file"), "safetensors"),
        (lambda p: (p / "x.txt").write_text("hello"), "unsupported"),
    ],
)
def test_bad_files(tmp, make, message):
    make(tmp)
    path = next(tmp.iterdir())
    with pytest.raises(LminvertError, match=message):
        HiddenStates.load(path)


def test_missing_file(tmp):
    with pytest.raises(LminvertError, match="not found"):
        HiddenStates.load(tmp / "nope.safetensors")


def test_mismatched_model(tmp, llama):
    path = encode(llama, [[5, 6, 7]], layer=1).save(tmp / "s.safetensors")
    other = lminvert.load_model("tiny-qwen2")
    with pytest.raises(LminvertError, match="weights hash"):
        check_compatible(HiddenStates.load(path), other, None)
    bare = HiddenStates.from_array(torch.zeros(3, 32))
    with pytest.raises(LminvertError, match="hidden size"):
        check_compatible(bare, llama, 1)
    assert check_compatible(HiddenStates.from_array(torch.zeros(3, 64)), llama, None) is None  # found by invert


def test_empty_text(llama):
    with pytest.raises(LminvertError, match="empty"):
        encode(llama, ["   "], layer=1)
