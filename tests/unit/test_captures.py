"""Captures as people save them: tensors, lists and dicts, masks and pad rows, other libraries' layer numbering."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import lminvert
from lminvert.captures import library_layer
from lminvert.errors import LminvertError
from lminvert.forward import padded_batch
from lminvert.invert import invert
from lminvert.invert.layerfit import fit_layers
from lminvert.invert.tolerance import add_noise
from lminvert.states import HiddenStates

from ..conftest import run_cli
from ..libraries import nnsight_states, transformer_lens_cache

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
    assert library_layer("15", "vllm", 30) == "15"  # eagle_aux_hidden_state_layer_ids count as lminvert's layers


def test_a_vllm_hidden_state_file(tmp_path):
    """vLLM's extract_hidden_states connector saves one file per request: hidden_states [K, T, d] (one slice per
    eagle_aux_hidden_state_layer_ids entry) and the prompt's token_ids."""
    model = lminvert.load_model("tiny-llama")
    ids = PROMPTS[0]
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    layer_ids = [0, 1]  # (hidden_states' last index, after the final norm, has no vLLM id)
    save_file(
        {"hidden_states": torch.stack([hidden[i][0] for i in layer_ids]), "token_ids": torch.tensor(ids)},
        str(tmp_path / "req-0.safetensors"),
    )
    with pytest.raises(LminvertError, match="--key"):
        HiddenStates.load(tmp_path / "req-0.safetensors")
    states = HiddenStates.load(tmp_path / "req-0.safetensors", key="hidden_states.1")
    torch.testing.assert_close(states.states[0], hidden[1][0], rtol=0, atol=0)
    assert any("vLLM" in n and "plain text" in n for n in states.notes)
    (result,) = invert(model, states, library_layer("1", "vllm", model.probe.n_layers))
    assert result.token_ids == ids


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_the_layer_is_found_at_every_layer_of_a_tiny_model(name):
    """The best layer is the true one at every layer (random tiny models' adjacent layers differ little, so it is
    not always decisive there; SmolLM2's are: tests/integration/test_captures_smollm2.py)."""
    model = lminvert.load_model(name)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.probe.vocab_size, (8,), generator=gen) for _ in range(3)]
    for layer in [*range(model.probe.n_layers + 1), "final"]:
        states = [model.probe.states(p[None], [layer])[model.probe.layer(layer)][0] for p in prompts]
        fit = fit_layers(model, states)
        assert (fit.best, fit.fits) == (str(layer), True), fit.describe()


def test_position_0_settles_a_layer_fit_that_is_not_decisive():
    """Where the scores cannot tell layers apart, position 0 chooses (its state depends on its token alone): the
    states' own layer, the only one whose first-position table holds a token within the bound; nothing where position
    0 lies beyond the bound at every close layer, or where more than TRIED layers are close."""
    from dataclasses import replace

    from lminvert.invert.layerchoice import resolve_layer
    from lminvert.invert.layerfit import MARGIN, TRIED, settle
    from lminvert.invert.sources import Float

    model = lminvert.load_model("tiny-llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.probe.vocab_size, (6,), generator=gen) for _ in range(2)]
    layer = model.probe.n_layers // 2 + 1
    states = [model.probe.states(p[None], [layer])[model.probe.layer(layer)][0] for p in prompts]
    fit = fit_layers(model, states, Float())
    assert fit.best == str(layer), fit.describe()
    near = fit.ranked[1]
    blurred = replace(fit, scores={**fit.scores, near: fit.scores[str(layer)] - MARGIN / 2})  # a wrong best
    assert not blurred.decisive and blurred.best == near
    settled = settle(model, states, blurred, Float())
    assert settled.decisive and settled.best == str(layer), settled.describe()
    assert f"could not tell it from layer {near}" in settled.describe()
    moved = [torch.cat([s[:1] * 3, s[1:]]) for s in states]  # position 0 of no token at any layer
    assert not settle(model, moved, blurred, Float()).decisive
    crowded = replace(fit, scores={name: fit.scores[str(layer)] + i for i, name in enumerate(fit.ranked)})
    assert len(crowded.close) > TRIED and not settle(model, states, crowded, Float()).decisive
    assert resolve_layer(model, states, None, Float())[0] == model.probe.layer(layer)


def test_nnsight_and_transformer_lens_captures_invert():
    model = lminvert.load_model("tiny-llama")
    ids = PROMPTS[0]
    block = 0
    layer = library_layer(str(block), "nnsight", model.probe.n_layers)
    captured = {
        "nnsight": nnsight_states(model, ids, block),
        "tl": transformer_lens_cache(model, ids)[f"blocks.{block}.hook_resid_post"],
        # RMSNorm models: compatibility mode folds the norms' weights into the next layers; the states differ by
        # rounding only, and invert as float states
        "tl-compat": transformer_lens_cache(model, ids, compatibility=True)[f"blocks.{block}.hook_resid_post"],
    }
    for how, states in captured.items():
        (result,) = invert(model, states, layer)
        assert result.token_ids == ids, how
        assert result.source == "float" and "uncertain" not in result.verdicts, (how, result.verdicts)


def test_transformer_lens_compatibility_mode_on_a_layernorm_model_is_refused():
    """GPT-2's LayerNorm: compatibility mode centres the writing weights, so every state loses its mean."""
    model = lminvert.load_model("tiny-gpt2")
    ids = PROMPTS[0]
    raw = transformer_lens_cache(model, ids)["blocks.0.hook_resid_post"]
    (result,) = invert(model, raw, 1)
    assert result.token_ids == ids
    centred = transformer_lens_cache(model, ids, compatibility=True)["blocks.0.hook_resid_post"]
    with pytest.raises(LminvertError, match="compatibility mode"):
        invert(model, centred, 1)
    (result,) = invert(model, centred, 1, check=False)  # searched anyway: nothing fits, nothing better than uncertain
    assert set(result.verdicts) == {"uncertain"} and any("no candidate fits" in n for n in result.notes)


@pytest.mark.parametrize("bos", [True, False])
def test_captures_with_and_without_bos_invert(bos):
    model = lminvert.load_model("tiny-llama")
    text = model.tokenize("Hello there, world")
    ids = [model.tokenizer.bos_token_id, *text] if bos else text
    states = model.probe.states(torch.tensor([ids]), [1])[model.probe.layer(1)][0]
    (result,) = invert(model, states, 1)
    assert result.token_ids == ids
    assert any(("is the BOS token" if bos else "is not the BOS token") in n for n in result.notes), result.notes


def test_a_time_bound_stops_the_search():
    """States that fit nothing are searched through the vocabulary at every position; a time bound stops that, and
    the positions it cut say so, none better than uncertain."""
    model = lminvert.load_model("tiny-llama")
    noise = torch.randn(6, model.probe.hidden_size, generator=torch.Generator().manual_seed(0))
    (result,) = invert(model, noise, 1, check=False, max_seconds=1e-6)
    assert set(result.verdicts) == {"uncertain"}
    assert any("time bound stopped the search at 6 of 6 positions" in n for n in result.notes), result.notes
    assert all(p.stopped for p in result.positions) and result.to_json()["stopped_positions"] == list(range(6))
    # the misfits come after the first stopped position: put down to the time bound, not (yet) to the states
    assert any("6 of 6 positions from position 0 on, where the time bound" in n for n in result.notes), result.notes
    assert not any("do not match this model" in n for n in result.notes), result.notes
    assert max(result.candidates_checked) < model.probe.vocab_size
    with pytest.raises(LminvertError, match="max_seconds"):
        invert(model, noise, 1, max_seconds=0)


def test_a_guess_ends_the_search_where_asked():
    """``InvertConfig.guess_ends`` (a prompt another search takes over, :func:`lminvert.invert.leaks.sink_retry`):
    after the prompt's first guess (here position 0: states that fit nothing, 512 candidates a position) every later
    position gets its first batch only, marked stopped and uncertain, with a note naming the guess; without it each is
    searched in full."""
    from lminvert.invert.engine import InvertConfig, invert_prompts

    model = lminvert.load_model("tiny-llama")
    noise = torch.randn(4, model.probe.hidden_size, generator=torch.Generator().manual_seed(1))
    ended = invert_prompts(model, [noise], 1, InvertConfig(max_candidates=512, guess_ends=True))[0]
    assert set(ended.verdicts) == {"uncertain"} and [p.stopped for p in ended.positions] == [False, True, True, True]
    assert any(n.startswith("a guess (the rows search") for n in ended.notes), ended.notes
    full = invert_prompts(model, [noise], 1, InvertConfig(max_candidates=512))[0]
    assert not any(p.stopped for p in full.positions) and not any("a guess" in n for n in full.notes)
    assert min(full.candidates_checked[1:]) > max(ended.candidates_checked[1:])


def test_a_half_precision_capture_says_its_dtype_and_a_cast_is_named_where_it_reads_badly(tmp_path):
    """A ``[1, T, d]`` bfloat16 tensor saved by a bfloat16 model is read as bfloat16 (as a ``[T, d]`` array is): the
    model runs in it and every token comes back claimed, no hint; a float32 model is refused in one line naming
    ``--dtype``. A float32 model's states cast to bfloat16 to be saved (read as a bfloat16 model's here: they fit
    at tiny-llama's layer 1) claim no wrong token, and read as named (``--dtype float32 --source quant:bf16``) give
    every token."""
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    ids = half.tokenize("A capture saved in half precision")
    with torch.no_grad():
        hidden = half.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1]
    torch.save(hidden, tmp_path / "half.pt")
    assert HiddenStates.load(tmp_path / "half.pt").dtype == "bfloat16"
    with pytest.raises(LminvertError, match="--dtype bfloat16"):
        invert(lminvert.load_model("tiny-llama"), HiddenStates.load(tmp_path / "half.pt"), 1)
    done = run_cli("invert", str(tmp_path / "half.pt"), "--model", "tiny-llama", "--layer", "1", "--json")
    (doc,) = json.loads(done.stdout)
    assert done.returncode == 0 and doc["token_ids"] == ids, done.stderr
    assert "uncertain" not in doc["verdicts"] and doc["dtype"] == "bfloat16", doc["verdicts"]
    done = run_cli("invert", str(tmp_path / "half.pt"), "--model", "tiny-llama", "--layer", "1")
    assert done.returncode == 0 and "--source quant:bf16" not in done.stderr, done.stderr

    full = lminvert.load_model("tiny-llama")
    cast = full.probe.states(torch.tensor([ids]), [1])[full.probe.layer(1)][0].bfloat16()
    torch.save(cast, tmp_path / "cast.pt")
    done = run_cli("invert", str(tmp_path / "cast.pt"), "--model", "tiny-llama", "--layer", "1", "--json")
    (doc,) = json.loads(done.stdout)
    claimed = [t for t, v in zip(doc["token_ids"], doc["verdicts"], strict=True) if v != "uncertain"]
    assert claimed == [t for t, v in zip(ids, doc["verdicts"], strict=True) if v != "uncertain"]  # never wrong, sure
    named = run_cli("invert", str(tmp_path / "cast.pt"), "--model", "tiny-llama", "--layer", "1", "--dtype",
                    "float32", "--source", "quant:bf16", "--json")  # fmt: skip
    (doc,) = json.loads(named.stdout)
    assert named.returncode == 0 and doc["token_ids"] == ids, named.stderr


def test_the_cast_hint_names_the_half_format_where_half_or_more_positions_are_uncertain(capsys):
    """``lminvert invert``'s hint for half-precision rows read as that precision's model: shown where a prompt has
    half or more positions uncertain under the ``float`` source, naming the cast's ``quant:`` kind; not otherwise."""
    from types import SimpleNamespace

    from lminvert.cli.recast import cast_hint

    model = SimpleNamespace(dtype="float16")

    def result(uncertain: int, source: str = "float"):
        return SimpleNamespace(source=source, token_ids=[1] * 6, uncertain_positions=list(range(uncertain)))

    for dtype, results, kind, shown in [
        ("float16", [result(2), result(3)], "states", True),
        ("float16", [result(2), result(3)], "kv", True),
        ("float16", [result(2)], "states", False),
        ("float16", [result(6, "noise:0.01")], "states", False),
        ("bfloat16", [result(6)], "states", False),  # the model runs in another dtype than the file's
        (None, [result(6)], "states", False),
        ("float16", [result(6)], "last", True),  # one vector: uncertain wherever its prompt is not found
        ("float16", [result(0)], "last", False),
    ]:
        cast_hint(model, dtype, results, kind)
        err = capsys.readouterr().err
        counted = ("3 of 6 positions are uncertain" in err) == (shown and kind != "last")
        not_found = ("no prompt was found for the vector" in err) == (shown and kind == "last")
        assert ("--source quant:fp16" in err) == shown and counted and not_found, (dtype, kind, err)
        assert ("KV cache" in err) == (shown and kind == "kv"), (dtype, kind, err)


def test_a_half_models_states_saved_wider_are_read_as_that_models(tmp_path):
    """A bfloat16 model's states saved as float32 (``.npy``: numpy has no bfloat16) or float64 are every one a
    bfloat16 number: ``invert`` without ``--dtype`` loads the model in bfloat16, says so in a note, and every token
    comes back claimed; float16's likewise; a float32 computation's are not such numbers; ``--dtype`` overrides."""
    ids = None
    for dtype in ("bfloat16", "float16"):
        half = lminvert.load_model("tiny-llama", dtype=dtype)
        ids = half.tokenize("A half model's states saved in float32")
        hidden = half.probe.states(torch.tensor([ids]), [1])[half.probe.layer(1)][0]
        np.save(tmp_path / f"{dtype}.npy", hidden.float().numpy())
        assert HiddenStates.from_array(hidden.double()).half_values() == dtype
        done = run_cli("invert", str(tmp_path / f"{dtype}.npy"), "--model", "tiny-llama", "--layer", "1", "--json")
        (doc,) = json.loads(done.stdout)
        assert done.returncode == 0 and doc["token_ids"] == ids and doc["dtype"] == dtype, done.stderr
        assert "uncertain" not in doc["verdicts"], doc["verdicts"]
        assert any(f"every value is a {dtype} number" in note for note in doc["notes"]), doc["notes"]
    full = lminvert.load_model("tiny-llama")
    hidden = full.probe.states(torch.tensor([ids]), [1])[full.probe.layer(1)][0].float()
    assert HiddenStates.from_array(hidden).half_values() is None
    assert HiddenStates.from_array(hidden.bfloat16().float(), dtype="float32").half_values() is None  # recorded
    forced = run_cli("invert", str(tmp_path / "bfloat16.npy"), "--model", "tiny-llama", "--layer", "1", "--dtype",
                     "float32", "--json")  # fmt: skip
    (doc,) = json.loads(forced.stdout)
    assert forced.returncode == 0 and doc["dtype"] == "float32", forced.stderr
    assert not any("every value is" in note for note in doc["notes"]), doc["notes"]


def test_a_half_models_kv_cache_saved_wider_is_read_as_that_models(tmp_path):
    """A bfloat16 model's KV cache saved as float32 (keys, values) pairs: ``invert --leak kv`` without ``--dtype``
    reads its rows as the bfloat16 numbers they are (a note says so) and every token comes back claimed; ``--dtype
    float32`` reads them as a float32 model's."""
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    ids = half.tokenize("A half model's cache saved in float32")
    with torch.no_grad():
        cache = half.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    torch.save([(layer.keys.float(), layer.values.float()) for layer in cache.layers], tmp_path / "cache.pt")
    done = run_cli("invert", str(tmp_path / "cache.pt"), "--model", "tiny-llama", "--layer", "2", "--json")
    (doc,) = json.loads(done.stdout)
    assert done.returncode == 0 and doc["token_ids"] == ids and doc["dtype"] == "bfloat16", done.stderr
    assert "uncertain" not in doc["verdicts"], doc["verdicts"]
    assert any("every value is a bfloat16 number" in note for note in doc["notes"]), doc["notes"]
    forced = run_cli("invert", str(tmp_path / "cache.pt"), "--model", "tiny-llama", "--layer", "2", "--dtype",
                     "float32", "--json")  # fmt: skip
    (doc,) = json.loads(forced.stdout)
    assert forced.returncode == 0 and doc["dtype"] == "float32", forced.stderr
    for dtype, told in ((None, True), ("float32", False)):  # inspect reads the file as invert does
        extra = ["--dtype", dtype] if dtype else []
        seen = run_cli("inspect", str(tmp_path / "cache.pt"), "--model", "tiny-llama", "--layer", "2", "--json", *extra)
        doc = json.loads(seen.stdout)
        assert seen.returncode == 0 and doc["fits_model"] and doc["dtype"] == (dtype or "bfloat16"), seen.stderr
        assert any("every value is a bfloat16 number" in note for note in doc["notes"]) == told, doc["notes"]


def test_invert_warns_before_searching_where_a_float32_model_reads_half_numbers(caplog):
    """``lminvert.invert`` with a float32 model and states whose every value is a bfloat16 number (a half model's,
    saved wider) warns before the search, naming ``dtype='bfloat16'`` and ``quant:bf16``; a float32 computation's
    states, or a defended source, get no such warning."""
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    full = lminvert.load_model("tiny-llama")
    ids = half.tokenize("Half numbers in a float32 array")
    wide = half.probe.states(torch.tensor([ids]), [1])[half.probe.layer(1)][0].float()
    own = full.probe.states(torch.tensor([ids]), [1])[full.probe.layer(1)][0].float()
    for states, source, warned in [(wide, "float", True), (own, "float", False), (wide, "quant:bf16", False)]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lminvert.invert"):
            invert(full, states, 1, source=source, max_seconds=5)
        said = [r.getMessage() for r in caplog.records if "is a bfloat16 number" in r.getMessage()]
        assert bool(said) == warned, (source, warned, said)
        assert not said or ("dtype='bfloat16'" in said[0] and "quant:bf16" in said[0])


def test_a_float32_models_states_cast_to_bfloat16_are_read_again_as_the_cast(tmp_path):
    """tiny-gemma3's layer-2 states computed in float32 and cast to bfloat16 to be saved leave every position
    ``uncertain`` read as a bfloat16 model's; their position-0 rows are the float32 table's rows rounded, not the
    bfloat16 table's (a bfloat16 model's rows are the reverse), so ``lminvert invert --layer 2`` without
    ``--dtype``/``--source`` reads the file as ``--dtype float32 --source quant:bf16`` from the start and says so, and
    a bfloat16 model's file as its own; with ``--source float`` given, it does not."""
    from lminvert.invert.casts import is_cast

    full, half = lminvert.load_model("tiny-gemma3"), lminvert.load_model("tiny-gemma3", dtype="bfloat16")
    ids = full.tokenize("A capture saved in half precision")
    layer = full.probe.layer(2)
    cast = full.probe.states(torch.tensor([ids]), [layer])[layer][0].bfloat16()
    own = half.probe.states(torch.tensor([ids]), [half.probe.layer(2)])[half.probe.layer(2)][0]
    assert is_cast(full, [cast[0]], layer, torch.bfloat16) and not is_cast(full, [own[0]], layer, torch.bfloat16)
    at = half.probe.layer(2)
    assert is_cast(half, [own[0]], at, torch.bfloat16) and not is_cast(half, [cast[0]], at, torch.bfloat16)
    torch.save(cast, tmp_path / "cast.pt")
    torch.save(own, tmp_path / "own.pt")
    done = run_cli("invert", str(tmp_path / "own.pt"), "--model", "tiny-gemma3", "--layer", "2", "--json")
    (doc,) = json.loads(done.stdout)
    assert done.returncode == 0 and doc["dtype"] == "bfloat16" and doc["source"] == "float", done.stderr
    assert not any("cast to bfloat16" in note for note in doc["notes"]), doc["notes"]
    args = ("invert", str(tmp_path / "cast.pt"), "--model", "tiny-gemma3", "--layer", "2", "--json")
    done = run_cli(*args)
    (doc,) = json.loads(done.stdout)
    assert done.returncode == 0 and doc["token_ids"] == ids, done.stderr
    assert doc["dtype"] == "float32" and doc["source"] == "quant:bf16", (doc["dtype"], doc["source"])
    assert any("not a bfloat16 model's: read as a float32 model's states cast" in note for note in doc["notes"])
    seen = run_cli("inspect", str(tmp_path / "cast.pt"), "--model", "tiny-gemma3", "--json")  # inspect says the same
    doc = json.loads(seen.stdout)
    assert seen.returncode == 0 and doc["layer"]["best"] == "2", (seen.stderr, doc.get("layer"))
    assert any("read as a float32 model's states cast" in note for note in doc["notes"]), doc["notes"]
    assert "--dtype float32 --source quant:bf16" in doc["command"], doc["command"]
    said = run_cli(*args, "--source", "float")
    (doc,) = json.loads(said.stdout)
    assert said.returncode == 0 and doc["dtype"] == "bfloat16" and doc["source"] == "float", said.stderr
    assert all(v == "uncertain" or t == i for t, i, v in zip(doc["token_ids"], ids, doc["verdicts"], strict=True))
    # a bfloat16 model's rows under 3% noise: as uncertain, but position 0 is no cast: not read again, the hint instead
    noisy = add_noise(own.float(), 0.03, torch.Generator().manual_seed(0)).bfloat16()
    torch.save(noisy, tmp_path / "noisy.pt")
    done = run_cli("invert", str(tmp_path / "noisy.pt"), "--model", "tiny-gemma3", "--layer", "2")
    assert done.returncode == 0 and "bfloat16 on cpu" in done.stdout, done.stdout
    assert "try --dtype float32 --source quant:bf16" in done.stderr, done.stderr


def test_a_kv_cache_cast_to_bfloat16_is_told_by_position_0_and_read_again(tmp_path):
    """tiny-llama's block-2 KV cache computed in float32 and saved as bfloat16 pairs: its position-0 row is the float32
    table's row through the view, rounded (a bfloat16 model's is not); given a first reading that left it mostly
    ``uncertain``, ``reread`` reads the cache again with the float32 model as ``quant:bf16``: every token, a note."""
    from types import SimpleNamespace

    from lminvert.cli.recast import reread
    from lminvert.invert import grouped
    from lminvert.invert.casts import is_cast
    from lminvert.invert.views import make_view
    from lminvert.kv_captures import read_kv

    full, half = lminvert.load_model("tiny-llama"), lminvert.load_model("tiny-llama", dtype="bfloat16")
    ids = full.tokenize("A cache saved in half precision")
    for model, name in [(full, "cast.pt"), (half, "half.pt")]:
        with torch.no_grad():
            cache = model.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        torch.save([(layer.keys.bfloat16(), layer.values.bfloat16()) for layer in cache.layers], tmp_path / name)
    block = full.probe.layer(2)
    view = make_view("kv", full, block)
    cast, own = read_kv(tmp_path / "cast.pt", block=2), read_kv(tmp_path / "half.pt", block=2)
    assert is_cast(full, [cast.rows[0][0]], block, torch.bfloat16, view, [0])
    assert not is_cast(full, [own.rows[0][0]], block, torch.bfloat16, view, [0])
    first = SimpleNamespace(source="float", token_ids=ids, uncertain_positions=list(range(len(ids))), layer="2",
                            seconds=1.0)  # fmt: skip
    args = SimpleNamespace(dtype=None, source=None, model="tiny-llama", device="cpu")
    leak, search, run = grouped("kv", None, None)
    model, results = reread(args, half, "tiny-llama", cast, leak, search, run, [first])
    (result,) = results
    assert model.dtype == "float32" and result.source == "quant:bf16" and result.token_ids == ids
    assert "uncertain" not in result.verdicts and "read again as a float32 model's KV cache" in result.notes[-1]
    assert result.seconds > first.seconds
    # the command, its block named: position 0 read first, the cast read once (a bfloat16 model's cache as its own)
    for name, dtype in (("cast.pt", "float32"), ("half.pt", "bfloat16")):
        done = run_cli("invert", str(tmp_path / name), "--model", "tiny-llama", "--layer", "2", "--json")
        (doc,) = json.loads(done.stdout)
        assert done.returncode == 0 and doc["dtype"] == dtype and doc["token_ids"] == ids, done.stderr
        told = any("not a bfloat16 model's: read as a float32 model's KV cache cast" in n for n in doc["notes"])
        assert told == (dtype == "float32") and "uncertain" not in doc["verdicts"], doc["notes"]
        seen = run_cli("inspect", str(tmp_path / name), "--model", "tiny-llama", "--layer", "2", "--json")
        doc = json.loads(seen.stdout)
        assert seen.returncode == 0 and doc["fits_model"], seen.stderr
        assert ("--source quant:bf16" in doc["command"]) == (dtype == "float32"), doc["command"]


def test_a_sliding_window_layers_cache_saved_as_pairs_is_told(tmp_path):
    """transformers' sliding-window layers keep a prompt's last ``window - 1`` positions: in a list of (keys, values)
    pairs the blocks that hold fewer positions than the others are not read as a prompt (the lowest block that holds
    every position is, with a note; naming a short one is refused in one line), and where every block is such a layer
    and holds all it keeps (tiny-mistral's 4-token window), inspect's note says the rows may be a longer prompt's
    end, as invert's does."""
    from lminvert.kv_captures import read_kv

    gemma = lminvert.load_model("tiny-gemma3")  # block 1 slides (a window of 512), block 2 attends over everything
    ids = torch.randint(10, 200, (600,)).tolist()
    with torch.no_grad():
        cache = gemma.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    pairs = [(layer.keys, layer.values) for layer in cache.layers]
    assert [k.shape[-2] for k, _ in pairs] == [511, 600]
    capture = read_kv(pairs)
    assert capture.block == 2 and len(capture.rows[0]) == 600
    assert any("block 1 holds only the last 511 of 600 positions" in note for note in capture.notes), capture.notes
    with pytest.raises(LminvertError, match=r"block 1 of .* holds the last 511 of the 600 positions"):
        read_kv(pairs, block=1)
    mistral = lminvert.load_model("tiny-mistral")
    for text, told in (("one two three four five six seven", True), ("one", False)):
        ids = mistral.tokenize(text)
        with torch.no_grad():
            cache = mistral.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        torch.save([(layer.keys, layer.values) for layer in cache.layers], tmp_path / "mistral.pt")
        seen = run_cli("inspect", str(tmp_path / "mistral.pt"), "--model", "tiny-mistral", "--layer", "1", "--json")
        doc = json.loads(seen.stdout)
        assert seen.returncode == 0, seen.stderr
        assert any("attends over a sliding window of 4" in note for note in doc["notes"]) == told, (text, doc["notes"])


def test_a_cast_is_not_told_before_the_search_without_a_kept_float32_table(tmp_path, monkeypatch):
    """Rows the half model's table does not reproduce (a cast, or a half capture from other kernels) load the float32
    model before the search only where its table at the layer is kept: else the first reading goes on as the half
    model's (the second reading serves a cast), with nothing loaded or built."""
    from types import SimpleNamespace

    import lminvert.cli.recast as recast
    from lminvert.invert import grouped
    from lminvert.invert.tables import first_position_table

    full, half = lminvert.load_model("tiny-gemma3"), lminvert.load_model("tiny-gemma3", dtype="bfloat16")
    ids = full.tokenize("A capture saved in half precision")
    layer = full.probe.layer(2)
    cast = HiddenStates.from_array(full.probe.states(torch.tensor([ids]), [layer])[layer][0].bfloat16())
    first_position_table(full, layer, progress=False)  # kept: the cast is told before the search
    args = SimpleNamespace(dtype=None, source=None, model="tiny-gemma3", device="cpu")
    leak = grouped("states", None, None)[0]
    model, told, at, note = recast.cast_first(args, half, "tiny-gemma3", cast, layer, leak)
    assert model.dtype == "float32" and told.source == "quant:bf16" and "not a bfloat16 model's" in note
    assert at == layer and " at layer" not in note
    model, told, at, note = recast.cast_first(args, half, "tiny-gemma3", cast, None, leak)  # the layer from the fit
    assert model.dtype == "float32" and told.source == "quant:bf16" and at == layer and "at layer 2" in note
    monkeypatch.setattr(recast, "table_path", lambda *a, **k: tmp_path / "none.safetensors")
    monkeypatch.setattr(recast, "model_from_args", lambda *a, **k: pytest.fail("the float32 model was loaded"))
    model, kept, at, note = recast.cast_first(args, half, "tiny-gemma3", cast, layer, leak)
    assert model is half and kept == leak and at == layer and note is None


def test_what_output_hidden_states_and_generate_save_is_read_by_layer(tmp_path):
    """``output_hidden_states`` saved whole (a tuple of ``[1, T, d]`` tensors of one shape, one per layer) is a file of
    layers, not of prompts; ``generate()``'s hidden states (a tuple per step of such tuples) give the first step's,
    the prompt's; an ``.npz`` gives its arrays by name. Before, the tuple was read as one prompt per layer and the
    generate tuple taken for a KV cache."""
    from lminvert.kv_captures import is_kv_file

    layers = tuple(torch.randn(1, 6, 64) for _ in range(5))
    torch.save(layers, tmp_path / "all.pt")
    with pytest.raises(LminvertError, match=r"holds 5 tensors, one per layer .*--key I"):
        HiddenStates.load(tmp_path / "all.pt")
    assert torch.equal(HiddenStates.load(tmp_path / "all.pt", key="3").states[0], layers[3][0])
    steps = (layers, *(tuple(torch.randn(1, 1, 64) for _ in range(5)) for _ in range(2)))
    torch.save(steps, tmp_path / "generate.pt")
    assert not is_kv_file(tmp_path / "generate.pt")
    read = HiddenStates.load(tmp_path / "generate.pt", key="2")
    assert torch.equal(read.states[0], layers[2][0]) and any("generate()" in n for n in read.notes)
    np.savez(tmp_path / "h.npz", hidden=layers[1][0].numpy(), mask=np.ones(6, dtype=np.int64))
    assert torch.equal(HiddenStates.load(tmp_path / "h.npz").states[0], layers[1][0])
    # prompts of different lengths saved as [1, T, d] each stay prompts
    torch.save([torch.randn(1, 4, 64), torch.randn(1, 2, 64)], tmp_path / "prompts.pt")
    assert HiddenStates.load(tmp_path / "prompts.pt").lengths == [4, 2]


def test_a_stack_of_every_layer_is_read_by_key_and_never_taken_for_prompts(tmp_path):
    """``torch.stack(output_hidden_states)`` saved as one array: ``[L + 1, 1, T, d]`` is refused with the ``--key`` that
    picks a layer, and ``--key I`` reads layer I; squeezed to ``[L + 1, T, d]`` it is refused by the layer fit (the
    first slice fits layer 0, the last the final layer) before any search, where before it was searched as L + 1
    prompts; a batch of prompts of one length at one layer is still read as prompts."""
    model = lminvert.load_model("tiny-llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == model.probe.n_layers + 1
    stacked = torch.stack(hidden)
    torch.save(stacked, tmp_path / "stack.pt")
    np.save(tmp_path / "stack.npy", stacked[:, 0].numpy())
    done = run_cli("invert", str(tmp_path / "stack.pt"), "--model", "tiny-llama")
    assert done.returncode != 0 and "--key I" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    read = HiddenStates.load(tmp_path / "stack.pt", key="1")
    assert torch.equal(read.states[0], hidden[1][0]) and read.lengths == [6]
    with pytest.raises(LminvertError, match="has 3 slices"):
        HiddenStates.load(tmp_path / "stack.pt", key="7")
    squeezed = HiddenStates.load(tmp_path / "stack.npy")
    assert squeezed.lengths == [6] * len(hidden)  # read as prompts: the model tells
    stacked_layers = r"one prompt's 3 layers stacked .*the first fits layer \w+, the last layer final.*--key"
    with pytest.raises(LminvertError, match=stacked_layers):
        invert(model, squeezed)
    (found,) = invert(model, HiddenStates.load(tmp_path / "stack.npy", key="1"))
    assert found.token_ids == ids[0].tolist()
    batch = torch.randint(0, model.probe.vocab_size, (len(hidden), 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        same_layer = model.model(input_ids=batch, output_hidden_states=True).hidden_states[1]
    results = invert(model, HiddenStates.from_array(same_layer))
    assert [r.token_ids for r in results] == batch.tolist()


def test_a_secant_fit_of_inputs_without_spread_gives_its_prior_not_an_error():
    from lminvert.invert.secant import fit_secant_map

    x, h = torch.zeros(3, 8), torch.randn(3, 5)
    assert torch.equal(fit_secant_map(x, h), torch.zeros(8, 5))
    prior = torch.randn(8, 5)
    assert torch.equal(fit_secant_map(x, h, prior=prior, prior_weight=0.5), prior)
