"""KV caches as people save them: transformers' cache objects, lists of pairs, one block's dict, safetensors names,
attention masks and pads, block numbering, and the one-line errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import StaticCache
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from lminvert.errors import LminvertError
from lminvert.kv_captures import KVCapture, is_kv_file, read_kv

from ..conftest import small_vocab_llama

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
PAD = 0
BLOCKS, HEADS, HEAD_DIM = 3, 2, 12  # small_vocab_llama: 3 blocks, 2 KV heads of 48 / 4 dims


@dataclass
class Run:
    """A padded batch's cache, its mask, and each block's expected rows per prompt (pads dropped)."""

    cache: DynamicCache
    mask: torch.Tensor
    expected: dict[int, list[torch.Tensor]]  # lminvert's block -> one [T_i, 2*H*hd] tensor per prompt
    offsets: tuple[int, ...]


@dataclass
class Opaque:  # a class torch.load(weights_only=True) must refuse
    keys: torch.Tensor


def _layout(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """KVBlock.cached's layout of one prompt's [H, T, hd] keys and values."""
    return torch.cat([keys.transpose(0, 1).flatten(1), values.transpose(0, 1).flatten(1)], dim=-1)


def _padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD)
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, prompt in enumerate(PROMPTS):
        span = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[i, span] = torch.tensor(prompt)
        mask[i, span] = 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return small_vocab_llama()


@pytest.fixture(scope="module", params=["left", "right"])
def run(request, model) -> Run:
    ids, mask = _padded(request.param)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    expected = {
        b: [_layout(layer.keys[i], layer.values[i])[mask[i].bool()] for i in range(len(PROMPTS))]
        for b, layer in enumerate(cache.layers, start=1)
    }
    offsets = tuple(int(m.nonzero()[0]) for m in mask)
    return Run(cache, mask, expected, offsets)


def _pairs(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _check(capture: KVCapture, run: Run, block: int, number: int | None = None, blocks: int | None = BLOCKS) -> None:
    assert len(capture.rows) == len(PROMPTS)
    for got, want in zip(capture.rows, run.expected[block], strict=True):
        assert torch.equal(got, want)
    assert capture.block == number
    assert capture.blocks == blocks
    assert (capture.heads, capture.head_dim) == (HEADS, HEAD_DIM)
    assert capture.offsets == run.offsets
    assert any("dropped 3 row(s) the attention mask marks as padding" in n for n in capture.notes)
    assert any("left padding" in n for n in capture.notes) == any(run.offsets)


def _error(match: str, *args, **kwargs) -> str:
    with pytest.raises(LminvertError, match=match) as caught:
        read_kv(*args, **kwargs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_saved_dynamic_cache_with_a_mask_file(tmp_path, run):
    torch.save(run.cache, tmp_path / "cache.pt")
    np.save(tmp_path / "mask.npy", run.mask.numpy())
    for block in range(1, BLOCKS + 1):
        capture = read_kv(tmp_path / "cache.pt", block=block, mask=tmp_path / "mask.npy")
        _check(capture, run, block, number=block)
    assert any("DynamicCache of 3 blocks" in n for n in capture.notes)


def test_a_cache_still_in_memory_reads_as_its_file(tmp_path, run):
    """``read_kv(out.past_key_values)`` (or the list of pairs, or a dict) without saving it first: the same rows as the
    saved file; something that holds no cache is the file's one-line error."""
    np.save(tmp_path / "mask.npy", run.mask.numpy())
    for given in (run.cache, _pairs(run.cache), {"past_key_values": _pairs(run.cache), "attention_mask": run.mask}):
        for block in range(1, BLOCKS + 1):
            mask = None if isinstance(given, dict) else tmp_path / "mask.npy"
            _check(read_kv(given, block=block, mask=mask), run, block, number=block)
    _error("the given cache holds no", torch.zeros(3))


def test_a_cache_without_its_mask_keeps_every_row_and_says_so(tmp_path, run):
    torch.save(run.cache, str(tmp_path / "cache.pt"))
    capture = read_kv(str(tmp_path / "cache.pt"), block=1)
    width = run.mask.shape[1]
    assert [len(r) for r in capture.rows] == [width, width]
    assert capture.offsets == (0, 0)
    assert any("pass --mask" in n for n in capture.notes)


def test_a_static_cache_is_cut_to_the_positions_it_holds(tmp_path, run, model):
    ids, mask = _padded("left" if any(run.offsets) else "right")
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    torch.save({"past_key_values": cache, "attention_mask": mask}, tmp_path / "static.pt")
    width = mask.shape[1]
    layer = cache.layers[2]
    assert layer.keys.shape[2] == 16  # the unused positions are zeros
    expected = [_layout(layer.keys[i, :, :width], layer.values[i, :, :width])[mask[i].bool()] for i in range(2)]
    _check(read_kv(tmp_path / "static.pt", block=3), Run(cache, mask, {3: expected}, run.offsets), 3, number=3)


def test_a_list_of_pairs_alone_or_in_a_dict_with_its_mask(tmp_path, run):
    torch.save(_pairs(run.cache), tmp_path / "list.pt")
    torch.save(run.mask, tmp_path / "mask.pt")
    _check(read_kv(tmp_path / "list.pt", block=2, mask=tmp_path / "mask.pt"), run, 2, number=2)
    legacy = tuple(_pairs(run.cache))  # to_legacy_cache()'s tuple of tuples
    torch.save({"past_key_values": legacy, "attention_mask": run.mask}, tmp_path / "dict.pt")
    capture = read_kv(tmp_path / "dict.pt", block=3)
    _check(capture, run, 3, number=3)
    assert capture.notes[:2] == (
        "read entry 'past_key_values' of dict.pt",
        "read a list of 3 (keys, values) pairs: block B is entry B-1",
    )


@pytest.mark.parametrize(
    ("k", "v", "m"),
    [("keys", "values", "attention_mask"), ("key", "value", "mask"), ("K", "V", "attention_mask"),
     ("Key_Cache", "Value_Cache", "mask")],
)  # fmt: skip
def test_one_blocks_tensors_in_a_dict(tmp_path, run, k, v, m):
    keys, values = _pairs(run.cache)[1]
    torch.save({k: keys, v: values, m: run.mask}, tmp_path / "block.pt")
    capture = read_kv(tmp_path / "block.pt", block=2)  # the block they came from: the file cannot say
    _check(capture, run, 2, number=None, blocks=None)
    assert any("does not say which block" in n for n in capture.notes)


def test_one_blocks_pair_alone(tmp_path, run):
    """``torch.save((layer.keys, layer.values), path)``: one block's two tensors, read as the block the caller names
    (a list of two pairs is a cache of two blocks, not one pair)."""
    torch.save(tuple(_pairs(run.cache)[1]), tmp_path / "pair.pt")
    assert is_kv_file(tmp_path / "pair.pt")
    capture = read_kv(tmp_path / "pair.pt", block=2, mask=None)
    assert capture.notes[0] == "read one block's (keys, values) pair"
    keys, values = _pairs(run.cache)[1]
    torch.save({"keys": keys, "values": values}, tmp_path / "dict.pt")
    same = read_kv(tmp_path / "dict.pt", block=2)
    assert len(capture.rows) == len(PROMPTS) and all(map(torch.equal, capture.rows, same.rows))
    torch.save(_pairs(run.cache)[:2], tmp_path / "two.pt")
    assert read_kv(tmp_path / "two.pt", block=2).blocks == 2


def test_one_prompts_tensors_as_heads_positions_dims(tmp_path, run):
    keys, values = _pairs(run.cache)[0]
    start = run.offsets[1]
    one = {"k": keys[1, :, start : start + 3].clone(), "v": values[1, :, start : start + 3].clone()}
    save_file(one, str(tmp_path / "one.safetensors"))
    capture = read_kv(tmp_path / "one.safetensors")
    assert len(capture.rows) == 1 and torch.equal(capture.rows[0], run.expected[1][1])
    assert capture.offsets == (0,) and not any("--mask" in n for n in capture.notes)


@pytest.mark.parametrize(
    ("k", "v"),
    [("past_key_values.{}.key", "past_key_values.{}.value"), ("layers.{}.keys", "layers.{}.values"),
     ("k_{}", "v_{}"), ("key_cache.{}", "value_cache.{}"), ("past_key_values.{}.0", "past_key_values.{}.1")],
)  # fmt: skip
def test_safetensors_names_give_the_block(tmp_path, run, k, v):
    tensors = {"attention_mask": run.mask, "input_ids": torch.zeros(2, 6, dtype=torch.long)}
    for i, (keys, values) in enumerate(_pairs(run.cache)):
        tensors |= {k.format(i): keys.contiguous(), v.format(i): values.contiguous()}
    save_file(tensors, str(tmp_path / "kv.safetensors"))
    capture = read_kv(tmp_path / "kv.safetensors", block=2)
    _check(capture, run, 2, number=2)
    assert any("0-based (an index 0 exists)" in n and f"'{k.format(0)}' is block 1" in n for n in capture.notes)
    assert any("ignored 1 entries" in n for n in capture.notes)
    assert is_kv_file(tmp_path / "kv.safetensors")


def test_safetensors_names_without_an_index_0_count_from_1(tmp_path, run):
    tensors = {"attention_mask": run.mask}
    for i, (keys, values) in enumerate(_pairs(run.cache), start=1):
        tensors |= {f"k_{i}": keys.contiguous(), f"v_{i}": values.contiguous()}
    save_file(tensors, str(tmp_path / "kv.safetensors"))
    capture = read_kv(tmp_path / "kv.safetensors", block=3)
    _check(capture, run, 3, number=3)
    assert any("1-based (no index 0)" in n for n in capture.notes)


def test_key_picks_among_several_caches(tmp_path, run):
    pairs = _pairs(run.cache)
    torch.save({"draft": pairs[:1], "target": pairs, "attention_mask": run.mask}, tmp_path / "two.pt")
    _error(r"holds 2 caches \(draft, target\): pick one with --key NAME", tmp_path / "two.pt")
    _check(read_kv(tmp_path / "two.pt", block=2, key="target"), run, 2, number=2)
    _error("has no entry 'x'", tmp_path / "two.pt", key="x")
    flat = {
        f"{name}.{i}.{kv}": t.clone()
        for name in ("a", "b")
        for i, pair in enumerate(pairs)
        for kv, t in zip("kv", pair, strict=True)
    }
    save_file(flat | {"attention_mask": run.mask}, str(tmp_path / "two.safetensors"))
    _error("all read as the keys of index 0: pick one set with --key PREFIX", tmp_path / "two.safetensors", block=1)
    _check(read_kv(tmp_path / "two.safetensors", block=1, key="b"), run, 1, number=1)


def test_the_dtype_is_kept(tmp_path, run):
    torch.save([(k.bfloat16(), v.bfloat16()) for k, v in _pairs(run.cache)], tmp_path / "bf16.pt")
    capture = read_kv(tmp_path / "bf16.pt", block=1, mask=None)
    assert all(r.dtype == torch.bfloat16 for r in capture.rows)


def test_a_whole_cache_without_a_block_is_read_at_its_lowest_with_a_note(tmp_path, run):
    torch.save({"past_key_values": run.cache, "attention_mask": run.mask}, tmp_path / "cache.pt")
    capture = read_kv(tmp_path / "cache.pt")
    _check(capture, run, 1, number=1)
    (note,) = [n for n in capture.notes if "holds 3 blocks" in n]
    assert note == (
        "cache.pt holds 3 blocks (1..3): block 1, the lowest, was read, as the earliest inverts fastest "
        "(pass --layer B for another; lminvert numbering: block B is transformers' cache.layers[B-1])"
    )
    assert not any("holds" in n for n in read_kv(tmp_path / "cache.pt", block=2).notes)  # asked for: no note
    _error(r"holds blocks 1\.\.3, not block 4: pass --layer B", tmp_path / "cache.pt", block=4)
    _error(r"holds blocks 1\.\.3, not block 0", tmp_path / "cache.pt", block=0)


def test_errors_on_files_that_are_not_kv_caches(tmp_path):
    _error("KV cache file not found", tmp_path / "missing.pt")
    torch.save(torch.randn(5, 48), tmp_path / "states.pt")
    _error(r"this looks like hidden states \(\[T, d\] or \[N, T, d\]\): drop --leak kv", tmp_path / "states.pt")
    torch.save({"hidden_states": torch.randn(2, 5, 48), "attention_mask": torch.ones(2, 5)}, tmp_path / "dict.pt")
    _error("drop --leak kv", tmp_path / "dict.pt")
    torch.save({"input_ids": torch.ones(5, dtype=torch.long)}, tmp_path / "ids.pt")
    _error(r"holds no KV cache: save torch.save\(out.past_key_values, path\)", tmp_path / "ids.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    _error("cannot read junk.pt", tmp_path / "junk.pt")
    torch.save(Opaque(torch.zeros(1)), tmp_path / "opaque.pt")
    message = _error("cannot load opaque.pt safely: it pickles", tmp_path / "opaque.pt")
    assert "Opaque" in message and r"torch.save([(l.keys, l.values) for l in cache.layers], path)" in message
    save_file({"keys": torch.zeros(1, 2, 3, 4)}, str(tmp_path / "lone.safetensors"))
    _error("entry 'keys' holds keys with no matching values", tmp_path / "lone.safetensors")
    save_file({"k_0": torch.zeros(1, 2, 3, 4), "v_1": torch.zeros(1, 2, 3, 4)}, str(tmp_path / "odd.safetensors"))
    _error("entry 'k_0' holds keys with no matching values at index 0", tmp_path / "odd.safetensors")


def test_errors_on_bad_tensors(tmp_path):
    good = torch.randn(2, 2, 4, 12)
    shapes = r"keys \[2, 2, 4, 12\] and values \[2, 2, 5, 12\] disagree"
    layout = r"give transformers' \[B, H, T, hd\] \(or one prompt's \[H, T, hd\]\)"
    nan = good.clone().index_fill_(2, torch.tensor([1]), float("nan"))
    cases = {
        "shapes": ({"k": good, "v": torch.randn(2, 2, 5, 12)}, shapes),
        "layout": ({"k": good[None], "v": good[None]}, layout),
        "empty": ({"k": good[:, :, :0], "v": good[:, :, :0]}, r"holds no positions \(T = 0\)"),
        "nan": ({"k": good, "v": nan}, "NaN or inf"),
        "ints": ({"k": good.long(), "v": good.long()}, "must be floating point"),
    }
    for name, (tensors, match) in cases.items():
        torch.save(tensors, tmp_path / f"{name}.pt")
        _error(match, tmp_path / f"{name}.pt")


def test_errors_on_bad_masks(tmp_path, run):
    torch.save(run.cache, tmp_path / "cache.pt")
    holes = run.mask.clone()
    holes[0] = torch.tensor([1, 0, 1, 1, 1, 1])
    torch.save(holes, tmp_path / "holes.pt")
    _error("the mask of prompt 0 has holes", tmp_path / "cache.pt", block=1, mask=tmp_path / "holes.pt")
    torch.save(run.mask[:, :4], tmp_path / "short.pt")
    short = r"the mask has shape \[2, 4\] but the cache holds 2 prompt\(s\) of 6 positions"
    _error(short, tmp_path / "cache.pt", block=1, mask=tmp_path / "short.pt")
    empty = run.mask.clone()
    empty[1] = 0
    torch.save(empty, tmp_path / "empty.pt")
    _error("the mask keeps no row of prompt 1", tmp_path / "cache.pt", block=1, mask=tmp_path / "empty.pt")
    torch.save(run.mask * 2, tmp_path / "twos.pt")
    _error("only 0 and 1", tmp_path / "cache.pt", block=1, mask=tmp_path / "twos.pt")


def test_a_sliding_window_layer_that_dropped_positions_is_refused(tmp_path):
    cache = DynamicCache()
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=3))
    cache.layers[0].update(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    torch.save(cache, tmp_path / "window.pt")
    _error("block 1 is a sliding-window layer that kept only the last 2 of 6 positions", tmp_path / "window.pt")


def test_is_kv_file_tells_states_from_caches(tmp_path, run):
    torch.save(torch.randn(2, 6, 48), tmp_path / "states.pt")
    torch.save({"hidden_states": torch.randn(2, 6, 48), "attention_mask": run.mask}, tmp_path / "states_dict.pt")
    np.save(tmp_path / "states.npy", np.zeros((6, 48), dtype=np.float32))
    save_file({"blocks.0.hook_resid_post": torch.randn(6, 48)}, str(tmp_path / "states.safetensors"))
    torch.save(run.cache, tmp_path / "cache.pt")
    torch.save(_pairs(run.cache), tmp_path / "list.pt")
    torch.save({"keys": torch.zeros(2, 2, 3, 4), "values": torch.zeros(2, 2, 3, 4)}, tmp_path / "block.pt")
    torch.save(Opaque(torch.zeros(1)), tmp_path / "opaque.pt")
    for name in ("states.pt", "states_dict.pt", "states.npy", "states.safetensors", "opaque.pt", "missing.pt"):
        assert not is_kv_file(tmp_path / name), name
    for name in ("cache.pt", "list.pt", "block.pt"):
        assert is_kv_file(tmp_path / name), name


def test_a_sliding_window_blocks_cache_end_to_end(tmp_path, cli):
    """tiny-mistral attends over a window of 4, and transformers' cache of each block keeps a prompt's last 3
    positions: saved whole, the file says so and is refused in one line; saved as bare (keys, values) pairs it cannot
    say so, and the inversion counts the 3 rows from position 0: no prompt fits them, every position is uncertain, and
    a note says why."""
    import json

    import lminvert

    model = lminvert.load_model("tiny-mistral")
    ids = list(model.tokenize("The quick brown fox jumps over the lazy dog near the river bank today", 12))
    with torch.no_grad():
        cache = model.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[-2] == 3
    torch.save(cache, tmp_path / "cache.pt")
    torch.save(_pairs(cache), tmp_path / "pairs.pt")
    refused = cli("invert", str(tmp_path / "cache.pt"), "--leak", "kv", "--model", "tiny-mistral")
    assert refused.returncode != 0 and "sliding-window layer that kept only the last 3 of 12" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    done = cli("invert", str(tmp_path / "pairs.pt"), "--leak", "kv", "--model", "tiny-mistral", "--json")
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)
    assert result["verdicts"] == ["uncertain"] * 3
    assert any("sliding window of 4 positions" in note for note in result["notes"])
