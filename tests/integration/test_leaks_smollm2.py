"""The real default model's leaks as a user holds them, through `lminvert invert`: a KV cache saved from a
transformers forward (a left-padded batch with its mask: every token of both prompts, positions sure), states
quantised to int8 (every token, positions sure: distances beyond the quantisation's box) and states under 1% noise
(every token, positions sure: the first chosen by the next row). Nothing wrong is ever claimed."""

from __future__ import annotations

import json

import torch

import lminvert
from lminvert.invert.sources import Quant
from lminvert.invert.tolerance import add_noise
from lminvert.states import HiddenStates

from ..conftest import run_cli

TEXTS = ["Contact Jane Doe at jane.doe@example.com", "Our staging password is Tr0ub4dor&3"]
CLAIMED = ("certified", "confident")


def _captured(model: lminvert.LoadedModel, ids: list[int]) -> torch.Tensor:
    """Layer 15's states of ``ids`` as a transformers user captures them (``hidden_states[15]``)."""
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[15][0]


def _noisy(model: lminvert.LoadedModel, ids: list[int], sigma: float, seed: int) -> lminvert.InversionResult:
    """``ids``' layer-15 capture under ``sigma`` relative noise (seed ``seed``), inverted as ``noise:sigma``, with
    nothing wrong claimed."""
    noisy = add_noise(_captured(model, ids).float(), sigma, torch.Generator().manual_seed(seed))
    (result,) = lminvert.invert(model, HiddenStates.from_array(noisy), 15, source=f"noise:{sigma}")
    _no_wrong_claim(result.token_ids, ids, result.verdicts)
    return result


def _no_wrong_claim(recovered: list[int], truth: list[int], verdicts: list[str]) -> None:
    for token, right, verdict in zip(recovered, truth, verdicts, strict=True):
        assert token == right or verdict not in CLAIMED, (recovered, truth, verdicts)


def test_a_left_padded_transformers_kv_cache_inverts_every_token(smollm2, tmp_path):
    tok = smollm2.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    try:
        batch = tok(TEXTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    with torch.no_grad():
        cache = smollm2.model(**batch, use_cache=True).past_key_values
    path = tmp_path / "cache.pt"
    pairs = [(x.keys, x.values) for x in cache.layers]
    torch.save({"past_key_values": pairs, "attention_mask": batch["attention_mask"]}, path)
    done = run_cli("invert", str(path), "--model", "smollm2-135m", "--layer", "15", "--json")
    assert done.returncode == 0, done.stderr
    for doc, text in zip(json.loads(done.stdout), TEXTS, strict=True):
        truth = list(smollm2.tokenize(text))
        _no_wrong_claim(doc["token_ids"], truth, doc["verdicts"])
        assert doc["token_ids"] == truth
        assert sum(v in CLAIMED for v in doc["verdicts"]) >= 0.9 * len(truth), doc["verdicts"]


def test_int8_states_invert_every_token_and_claim_nothing_wrong(smollm2):
    ids = list(smollm2.tokenize(TEXTS[1]))
    hidden = _captured(smollm2, ids)
    (result,) = lminvert.invert(smollm2, HiddenStates.from_array(Quant(kind="int8").quantise(hidden)), 15,
                                source="quant:int8")  # fmt: skip
    assert result.policy == "rows"
    _no_wrong_claim(result.token_ids, ids, result.verdicts)
    assert result.token_ids == ids
    assert sum(v in CLAIMED for v in result.verdicts) >= 0.9 * len(ids), result.verdicts  # the box: rows that fit


def test_states_under_one_percent_noise_invert_every_token_and_most_positions_are_confident(smollm2):
    """Position 0 (an attention sink: noise covers the gaps between first tokens there) is chosen by the next row,
    and confident where that rule's evidence holds; later positions are judged on their own rows."""
    ids = list(smollm2.tokenize(TEXTS[1]))
    result = _noisy(smollm2, ids, 0.01, 3)
    assert result.token_ids == ids
    assert sum(v in CLAIMED for v in result.verdicts) >= 0.9 * len(ids), result.verdicts


def test_under_three_percent_noise_the_next_row_finds_a_token_neither_prediction_nor_reading_ranks(smollm2):
    """Position 0 is chosen by the next row, whose token is sought under each likely first token: after "Inv",
    "oice" stands about 41,000th in the model's prediction and 31,000th in the row's reading, so a search by those
    alone gives up (1,024 candidates) and the prompt comes back wrong from position 0; the secant model, started from
    the position-1 map, puts it in the first batch. (Before: 3 of these 6 tokens, and 1 of 4 noise seeds exact.)"""
    text = "Invoice 2024-0871: 14 units at 37.50 EUR each, net 525.00, VAT 19% 99.75, total due 624.75 by 30 June."
    ids = list(smollm2.tokenize(text))[:6]
    assert _noisy(smollm2, ids, 0.03, 2).token_ids == ids


def test_one_blocks_cache_saved_without_its_number_is_found_from_its_rows_and_inverted(smollm2, tmp_path):
    """A file that holds one block's keys and values and does not say which block: the block is found from the rows
    (:mod:`lminvert.invert.blockfit`), noted, and searched; a block the rows decisively are not is never taken."""
    ids = list(smollm2.tokenize(TEXTS[0]))[:8]
    with torch.no_grad():
        cache = smollm2.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    path = tmp_path / "block.pt"
    torch.save({"keys": cache.layers[14].keys, "values": cache.layers[14].values}, path)
    done = run_cli("invert", str(path), "--model", "smollm2-135m", "--json")
    assert done.returncode == 0, done.stderr
    (doc,) = json.loads(done.stdout)
    assert doc["token_ids"] == ids
    assert any(note.startswith("block 15 found from the rows") for note in doc["notes"]), doc["notes"]
    # keys and values as an attention hook sees them (repeat_kv: each of the 3 KV heads 3 times), a block given: the
    # heads read once each and that block searched; a block the rows rule out refused in one line (it was ignored)
    keys, values = (t.repeat_interleave(3, dim=1) for t in (cache.layers[14].keys, cache.layers[14].values))
    torch.save((keys, values), path)
    done = run_cli("invert", str(path), "--model", "smollm2-135m", "--layer", "15", "--json")
    (doc,) = json.loads(done.stdout)
    assert doc["token_ids"] == ids and doc["layer"] == "15", done.stderr
    assert any("3 KV heads 3 times (repeat_kv" in n for n in doc["notes"]), doc["notes"]
    assert not any("found from the rows" in n for n in doc["notes"]), doc["notes"]
    done = run_cli("invert", str(path), "--model", "smollm2-135m", "--layer", "14")
    assert done.returncode != 0 and "not block 14: pass --layer 15" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
    torch.save((keys.roll(1, dims=1), values), path)  # 9 heads that are no repeat of the model's 3
    done = run_cli("invert", str(path), "--model", "smollm2-135m", "--layer", "15")
    assert done.returncode != 0 and "keep 3 KV heads of 64" in done.stderr and done.stderr.count("\n") == 1


def test_block_1s_cache_is_read_position_by_position_from_the_table(smollm2):
    """Block 1's keys and values depend on each token and its position alone (:attr:`lminvert.invert.views.View.alone`):
    every later position's row, rotated back to position 0, is nearest its own token's table row, so the first batch
    (``rows.search.FIRST`` candidates, nearest first) holds it and no prediction runs; every token, every position
    sure, in float32 and bfloat16."""
    from lminvert.invert.rows.search import FIRST

    ids = list(smollm2.tokenize(TEXTS[0]))
    for model in (smollm2, lminvert.load_model("smollm2-135m", dtype="bfloat16")):
        with torch.no_grad():
            entry = model.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values.layers[0]
        rows = torch.cat([entry.keys[0].transpose(0, 1).flatten(1), entry.values[0].transpose(0, 1).flatten(1)], -1)
        (result,) = lminvert.invert(model, HiddenStates.from_array(rows.float()), 1, leak="kv")
        _no_wrong_claim(result.token_ids, ids, result.verdicts)
        assert result.token_ids == ids
        assert all(v in CLAIMED for v in result.verdicts), result.verdicts
        assert all(n <= FIRST for n in result.candidates_checked[1:]), result.candidates_checked


def test_a_bfloat16_caches_first_token_is_reproduced_run_alone(smollm2, monkeypatch):
    """A bfloat16 cache's position 0 is computed as the token's own forward computes it (attention sees nothing before
    it), while the batched first-position table may round otherwise: the true first token, run alone through the view's
    capture, reproduces the row bit for bit and is certified for it; every token right, every position sure. Where
    this CPU's batched kernels round the table's row as the token's own forward does (this AVX512-BF16 one did; the
    AVX2 ones emulating bfloat16 did not), the table's row is moved by a unit of bfloat16 first: the case arises on
    every CPU."""
    from lminvert.invert.rows import attack
    from lminvert.invert.tables import first_position_table
    from lminvert.invert.views import make_view

    model = lminvert.load_model("smollm2-135m", dtype="bfloat16")
    ids = list(model.tokenize(TEXTS[1]))[:8]
    view = make_view("kv", model, model.probe.layer(7))  # it reads layer 6, whose tables the precision tests build
    rows = view.capture(ids)
    table = view.rows_of(first_position_table(model, view.states_layer, progress=False)[ids[0]][None].float(), 0)
    kept = ("rows-table", "kv", view.layer.name)  # the attack's table, kept on the loaded model
    if torch.equal(table[0], rows[0]):  # the batched table reproduces it here: make it not, as it does not elsewhere

        def nudged(model, layer, progress=True):
            states = first_position_table(model, layer, progress=progress).clone()
            states[ids[0]] = (states[ids[0]].float() * (1 + 2**-7)).to(states.dtype)  # a unit of bfloat16 away
            return states

        monkeypatch.setattr(attack, "first_position_table", nudged)
        table = view.rows_of(nudged(model, view.states_layer)[ids[0]][None].float(), 0)
    assert not torch.equal(table[0], rows[0])  # the table does not reproduce it: the case this is about
    model.memo.pop(kept, None)
    try:
        (result,) = lminvert.invert(model, HiddenStates.from_array(rows), 7, leak="kv")
    finally:
        model.memo.pop(kept, None)
    _no_wrong_claim(result.token_ids, ids, result.verdicts)
    assert result.token_ids == ids
    assert result.verdicts[0] == "certified" and "reproduces" in result.positions[0].reason, result.positions[0]
    assert all(v in CLAIMED for v in result.verdicts), result.verdicts


def test_a_float32_models_cache_saved_in_float16_inverts_through_its_cast(smollm2, tmp_path):
    """Block 15's cache of a float32 forward saved in float16 (to halve its size): refused in one line that names
    ``--source quant:fp16``, then inverted through it with every token right and every position sure (the rows'
    distances beyond the cast's box)."""
    ids = list(smollm2.tokenize(TEXTS[1]))[:8]
    with torch.no_grad():
        cache = smollm2.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    path = tmp_path / "half.pt"
    torch.save({"keys": cache.layers[14].keys.half(), "values": cache.layers[14].values.half()}, path)
    refused = run_cli("invert", str(path), "--model", "smollm2-135m", "--layer", "15", "--dtype", "float32")
    assert refused.returncode != 0 and "--source quant:fp16" in refused.stderr, refused.stderr
    done = run_cli(
        "invert", str(path), "--model", "smollm2-135m", "--layer", "15", "--dtype", "float32",
        "--source", "quant:fp16", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (doc,) = json.loads(done.stdout)
    assert doc["token_ids"] == ids
    assert all(v in CLAIMED for v in doc["verdicts"]), doc["verdicts"]
