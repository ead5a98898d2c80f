"""The reading network: trained on request only, cached beside the tables, used by inversion where cached."""

from __future__ import annotations

import re

import pytest
import torch

import lminvert
from lminvert.forward import encode, prompt_states
from lminvert.invert import invert, preparation, reading
from lminvert.invert import proposal as proposal_module
from lminvert.invert.preparation import Preparation, prepare
from lminvert.invert.reader import QUICK_KIND, load_reader, reading_for, train_reader
from lminvert.invert.reading import reading_map, reading_orders
from lminvert.invert.rows.back import back_map
from lminvert.invert.tables import table_path
from lminvert.invert.tolerance import calibrate, calibration_kind, calibration_prompts, measure
from lminvert.invert.views import make_view

PREPARE = ["models", "--prepare", "tiny-llama", "--no-inversion"]  # --reader alone, not the preparation


def test_a_reading_network_is_trained_on_request_cached_and_used_by_inversion(isolated_cache, monkeypatch):
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    assert load_reader(model, layer) is None  # never trained implicitly
    net = train_reader(model, layer, text=40, random=40, length=12, epochs=30, hidden=128, lr=1e-2, progress=False)
    assert table_path(model, layer, "reader").is_file()
    again = lminvert.load_model("tiny-llama")  # a new object reads the file
    loaded = load_reader(again, layer)
    assert loaded is not None
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), loaded.state_dict().values(), strict=True))
    # it reads tokens it was not trained on: 880 training samples from a 49,152-token vocabulary, so a few of 36 (by
    # chance: about 36 / 49,152 in all)
    gen = torch.Generator().manual_seed(7)
    fresh = torch.randint(0, again.probe.vocab_size, (4, 10), generator=gen).tolist()
    hits = 0
    for ids, states in zip(fresh, prompt_states(again, fresh, [layer], progress=False), strict=True):
        orders = reading_orders(again, loaded, states[layer], 1)
        hits += sum(int(orders[t, 0]) == ids[t] for t in range(1, len(ids)))
    assert hits >= 3
    # inversion proposes from it (instead of the linear map) and stays exact
    seen = []
    real = proposal_module.read
    monkeypatch.setattr(proposal_module, "read", lambda w, s: seen.append(w) or real(w, s))
    (result,) = invert(again, encode(again, [fresh[0]], layer))
    assert result.token_ids == fresh[0] and result.uncertain_positions == []
    assert seen and all(w is loaded for w in seen)


def test_the_cli_builds_first_position_tables_of_named_layers_in_one_pass_and_refuses_unknown_ones(
    cli, isolated_cache, monkeypatch
):
    from lminvert.invert import tables

    proc = cli("models", "--tables", "1")
    assert proc.returncode == 2 and "--prepare" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = cli(*PREPARE, "--tables", "1,99")
    assert proc.returncode == 2 and "layer 99" in proc.stderr and "Traceback" not in proc.stderr
    assert not (isolated_cache / "tables").exists() or not any((isolated_cache / "tables").iterdir())  # nothing built
    passes = []
    real = tables.vocabulary_states
    monkeypatch.setattr(tables, "vocabulary_states", lambda *a, **k: passes.append(a[2]) or real(*a, **k))
    proc = cli(*PREPARE, "--tables", "2,0,1")
    assert proc.returncode == 0, proc.stderr
    assert [[int(layer) for layer in layers] for layers in passes] == [[0, 1, 2]]  # one pass, every layer read in it
    model = lminvert.load_model("tiny-llama")
    ids = torch.arange(64)[:, None]  # the first 64 tokens, each alone
    for layer in model.probe.layers([0, 1, 2]):
        kept = tables.kept(model, layer, "table")
        alone = model.probe.states(ids, [layer])[layer][:, 0]
        assert kept is not None and torch.allclose(kept[:64], alone, rtol=1e-4, atol=1e-5)  # each token's state alone
    proc = cli(*PREPARE, "--tables", "1,2")
    assert proc.returncode == 0 and len(passes) == 1  # kept: nothing built again


def test_the_cli_trains_readers_only_for_a_named_model_and_known_layers(cli, isolated_cache):
    proc = cli("models", "--reader", "2")
    assert proc.returncode != 0 and "--prepare" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = cli("models", "--prepare", "tiny-llama", "--no-inversion", "--reader", "99", "--device", "cpu")
    assert proc.returncode != 0 and "layer" in proc.stderr and "Traceback" not in proc.stderr
    assert not (isolated_cache / "tables").exists() or not any((isolated_cache / "tables").glob("*reader*"))


def test_the_cli_skips_layers_with_a_cached_network_unless_told_to_retrain(isolated_cache, monkeypatch, capsys):
    """`make readers` twice trains nothing the second time; --retrain trains again; only missing layers are trained."""
    from lminvert.cli import main
    from lminvert.invert import reader

    model = lminvert.load_model("tiny-llama")
    train_reader(model, model.probe.layer(1), text=0, random=4, length=6, epochs=1, hidden=16, progress=False)
    trained = []
    settings = []

    def fake(m, layers, **kw):
        for layer in layers:
            trained.append(int(layer))
            settings.append(kw)
        return {layer: None for layer in layers}

    monkeypatch.setattr(reader, "train_readers", fake)
    assert main([*PREPARE, "--reader", "1,2", "--device", "cpu"]) == 0
    assert trained == [2]  # layer 1's network is cached, layer 2 has none
    assert "layer 1 already cached" in capsys.readouterr().out
    assert main([*PREPARE, "--reader", "1", "--retrain", "--device", "cpu"]) == 0
    assert trained == [2, 1]
    assert main([*PREPARE, "--reader", "1", "--dtype", "float16", "--device", "cpu"]) == 0
    assert trained == [2, 1, 1]  # a half model's own network is not the float32 one it falls back on
    assert settings == [{}, {}, {}]  # the default softmax
    assert main([*PREPARE, "--reader", "1", "--retrain", "--negatives", "0"]) == 0
    assert settings[-1] == {"negatives": 0}  # the whole vocabulary
    assert main([*PREPARE, "--reader", "1", "--retrain", "--random-prompts", "40"]) == 0
    assert settings[-1] == {"random": 40}
    assert main([*PREPARE, "--reader", "1", "--retrain", "--products", "float32"]) == 0
    assert settings[-1] == {"bfloat16": False}


def test_readers_for_several_layers_share_one_pass_of_forwards(isolated_cache, monkeypatch):
    """train_readers computes the training prompts' states once for all its layers (as many as STATES_BYTES holds)
    and trains each layer's network exactly as train_reader alone does."""
    from lminvert import forward
    from lminvert.invert import reader

    model = lminvert.load_model("tiny-llama")
    layers = [model.probe.layer(1), model.probe.layer(2)]
    settings = {"text": 0, "random": 8, "length": 6, "epochs": 1, "hidden": 16}
    alone = [train_reader(model, layer, progress=False, **settings).state_dict() for layer in layers]
    passes = []
    real = forward.prompt_states
    monkeypatch.setattr(reading, "prompt_states", lambda *a, **kw: passes.append(a[2]) or real(*a, **kw))
    together = reader.train_readers(model, list(reversed(layers)), progress=False, **settings)
    assert passes == [layers]  # one pass, for both layers
    for layer, weights in zip(layers, alone, strict=True):
        shared = together[layer].state_dict().values()
        assert all(torch.equal(a, b) for a, b in zip(weights.values(), shared, strict=True))
    monkeypatch.setattr(reader, "STATES_BYTES", 1)  # room for one layer's states at a time: one pass per layer
    passes.clear()
    reader.train_readers(model, layers, progress=False, **settings)
    assert passes == [[layers[0]], [layers[1]]]


def test_training_runs_its_products_in_bfloat16_where_they_are_fast(isolated_cache, monkeypatch):
    """bfloat16 products (autocast) on a GPU and on a CPU with native bfloat16 GEMMs, float32 elsewhere; either way a
    float32 network that reads the tokens it was trained on."""
    from lminvert.invert import reader
    from lminvert.models import halfmath

    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2"}))  # an AVX2 CPU emulates bfloat16
    assert not reader.bfloat16_training(torch.device("cpu"))
    assert reader.bfloat16_training(torch.device("cuda"))
    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert reader.bfloat16_training(torch.device("cpu"))
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    settings = {"text": 0, "random": 40, "length": 12, "epochs": 30, "hidden": 128, "lr": 1e-2}
    nets = {flag: train_reader(model, layer, bfloat16=flag, progress=False, **settings) for flag in (False, True)}
    prompts = reader.training_prompts(model, 0, 40, 12, reader.SEED)
    hits = {}
    for flag, net in nets.items():
        assert all(p.dtype == torch.float32 for p in net.parameters())
        hits[flag] = 0
        for ids, states in zip(prompts, prompt_states(model, prompts, [layer], progress=False), strict=True):
            orders = reading_orders(model, net, states[layer], 1)
            hits[flag] += sum(int(orders[t, 0]) == ids[t] for t in range(1, len(ids)))
    assert not torch.equal(nets[False][0].weight, nets[True][0].weight)  # the products did differ
    # 440 positions of a 49,152-token vocabulary: chance is ~0 hits; float32 read 114 when this was written
    assert hits[False] >= 80 and hits[True] >= 0.9 * hits[False], hits


def test_the_training_prompts_forward_runs_in_bfloat16_where_native_and_its_states_stay_near(
    isolated_cache, monkeypatch
):
    """The training prompts' states from a forward whose products run in bfloat16 (where those are native, for a
    float32 model): float32, within a few percent of the float32 forward's, not equal to them; a half model's forward
    and ``bfloat16=False`` stay as they are."""
    from lminvert.invert import reader
    from lminvert.models import halfmath

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not reading.half_states(model, None)
    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert reading.half_states(model, None) and not reading.half_states(model, False)
    assert not reading.half_states(lminvert.load_model("tiny-llama", dtype="bfloat16"), True)
    prompts = reader.training_prompts(model, 0, 6, 10, reader.SEED)
    exact = prompt_states(model, prompts, [layer], progress=False)
    assert all(
        torch.equal(a[layer], b[layer])
        for a, b in zip(exact, reader.training_states(model, prompts, [layer], False, False), strict=True)
    )
    half = reader.training_states(model, prompts, [layer], True, False)
    off = torch.cat(
        [(h[layer] - e[layer]).norm(dim=1) / e[layer].norm(dim=1) for h, e in zip(half, exact, strict=True)]
    )
    assert all(h[layer].dtype == torch.float32 for h in half)
    assert 0 < float(off.max()) < 0.05, off  # bfloat16 keeps 8 bits: about 0.4% a product, a few of them per block


def test_the_preparations_checks_rank_with_bfloat16_products_nearly_as_float32_ranks(isolated_cache, monkeypatch):
    """``held_out_ranks(half=True)`` (the preparation's checks, where bfloat16 is native): the vocabulary product on a
    bfloat16 copy, its distances within a small part of the float32 ones and the ranks nearly the same; with the
    switch off (``vocabulary.HALF_RANKS``) or where bfloat16 is not native, float32."""
    from lminvert.invert import reader
    from lminvert.models import halfmath, vocabulary

    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    prompts = reader.training_prompts(model, 0, 6, 12, 5)
    states = [s[layer] for s in prompt_states(model, prompts, [layer], progress=False)]
    weights = reading_map(model, layer)
    read = reading.read(weights, states[0])
    full, half = reading.input_distances(model, read), reading.input_distances(model, read, half=True)
    assert full.dtype == half.dtype == torch.float32 and not torch.equal(full, half)
    assert float((full - half).abs().max()) <= 0.02 * float(full.abs().max())
    exact = reader.held_out_ranks(model, weights, prompts, states)
    close = reader.held_out_ranks(model, weights, prompts, states, half=True)
    assert sum(abs(a - b) <= max(2, 0.01 * a) for a, b in zip(exact, close, strict=True)) >= 0.9 * len(exact)
    monkeypatch.setattr(vocabulary, "HALF_RANKS", False)
    assert torch.equal(reading.input_distances(model, read, half=True), full)
    monkeypatch.setattr(vocabulary, "HALF_RANKS", True)
    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2"}))
    assert torch.equal(reading.input_distances(model, read, half=True), full)


def test_true_ranks_count_what_input_distances_rank_without_their_matrix(monkeypatch):
    """``reading.true_ranks``: the number of tokens strictly nearer than the true one by ``input_distances``, counted
    over vocabulary chunks (several chunks here); the true token never counts itself; float32 and bfloat16 products."""
    from lminvert.models import halfmath

    monkeypatch.setattr(halfmath, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(reading, "RANK_CHUNK", 100)
    model = lminvert.load_model("tiny-llama")
    vocab = model.probe.vocab_matrix(torch.float32)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.probe.vocab_size, (40,), generator=generator)
    spread = torch.tensor([0.0, 0.5, 2.0, 8.0]).repeat(10)[:, None]  # the true token first, then farther down
    predicted = vocab[tokens] + spread * torch.randn(40, vocab.shape[1], generator=generator) * vocab.std()
    for half in (False, True):
        scores = reading.input_distances(model, predicted, half)
        expected = (scores < scores.gather(1, tokens[:, None])).sum(1)
        got = reading.true_ranks(model, predicted, tokens, half)
        assert got.dtype == torch.int64 and got.shape == (40,)
        assert torch.equal(got, expected) if not half else bool(((got - expected).abs() <= 1).all()), (got, expected)
        assert int(expected.max()) > 100 and int(expected.min()) == 0  # ranks across chunks, and a first place


@pytest.mark.parametrize(
    "option",
    [
        ["--retrain"],
        ["--negatives", "0"],
        ["--reader", "1", "--negatives", "-1"],
        ["--random-prompts", "10"],
        ["--reader", "1", "--random-prompts", "-1"],
        ["--products", "float32"],
    ],
)
def test_training_options_need_reader_layers(cli, option):
    proc = cli("models", "--prepare", "tiny-llama", *option)
    assert proc.returncode != 0 and "--reader" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_hooked_model_keeps_its_reading_network_off_the_disk(isolated_cache):
    """Forward hooks change what the weights compute; the weights hash cannot tell, so no file is written or read."""
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    train_reader(model, layer, text=0, random=4, length=6, epochs=1, hidden=16, progress=False)  # a file, unhooked
    hooked = lminvert.load_model("tiny-llama")
    hooked.probe.blocks[0].register_forward_hook(lambda m, a, out: out)
    assert load_reader(hooked, layer) is None  # the unhooked model's file is not read
    net = train_reader(hooked, layer, text=0, random=4, length=6, epochs=1, hidden=16, progress=False)
    assert load_reader(hooked, layer) is net  # kept in memory
    assert len(list((isolated_cache / "tables").glob("*reader*"))) == 1  # only the unhooked model's


def test_a_training_steps_softmax_over_drawn_rows_keeps_every_target_and_the_whole_vocabularys_scores():
    from lminvert.invert.reader import _scores

    gen = torch.Generator().manual_seed(3)
    vocab = torch.randn(300, 8, generator=gen, dtype=torch.float64)
    norms = (vocab * vocab).sum(1)
    read = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    tokens = torch.tensor([5, 299, 0, 5, 123, 77])
    full, same = _scores(read, tokens, vocab, norms, 0)
    assert full.shape == (6, 300) and torch.equal(same, tokens)
    assert torch.allclose(full, 2 * read @ vocab.T - norms)
    assert torch.equal(_scores(read, tokens, vocab, norms, 300)[0], full)  # as many as the vocabulary: all of it
    drawn, targets = _scores(read, tokens, vocab, norms, 40)
    width = drawn.shape[1]
    assert 40 <= width <= 46
    shift = torch.log(torch.tensor(300 / width, dtype=torch.float64))
    for row in range(6):
        assert torch.isclose(drawn[row, targets[row]], full[row, tokens[row]])  # the target, unshifted
        others = torch.cat([drawn[row, : targets[row]], drawn[row, targets[row] + 1 :]]) - shift
        assert (others[:, None] - full[row][None]).abs().min(1).values.max() < 1e-9  # the others: vocabulary scores


def test_the_cli_says_how_to_train_a_reading_network_where_none_is_cached(cli, isolated_cache, tmp):
    path = tmp / "s.safetensors"
    cli("encode", "--model", "tiny-llama", "--layer", "2", "--text", "Secret: 1234", "--out", str(path), check=True)
    proc = cli("invert", str(path), "--device", "cpu", check=True)
    hint = [line for line in proc.stderr.splitlines() if line.startswith("hint:")]
    assert len(hint) == 1 and "lminvert models --prepare tiny-llama --reader 2`" in hint[0]
    assert "hint:" not in cli("invert", str(path), "--device", "cpu", "--policy", "secant", check=True).stderr
    assert "hint:" not in cli("invert", str(path), "--device", "cpu", "--certify", check=True).stderr  # a sweep
    model = lminvert.load_model("tiny-llama")
    train_reader(model, model.probe.layer(2), text=0, random=4, length=6, epochs=1, hidden=16, progress=False)
    proc = cli("invert", str(path), "--device", "cpu", check=True)
    assert "hint:" not in proc.stderr and "Secret: 1234" in proc.stdout


def test_a_half_model_reads_with_the_network_trained_in_float32_unless_its_own_is_cached(isolated_cache):
    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(1)
    net = train_reader(model, layer, text=0, random=4, length=6, epochs=1, hidden=16, progress=False)
    half = lminvert.load_model("tiny-llama", dtype="bfloat16")
    shared = load_reader(half, layer)
    assert shared is not None and shared is not net
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), shared.state_dict().values(), strict=True))
    own = train_reader(half, layer, text=0, random=4, length=6, epochs=1, hidden=8, progress=False)
    again = lminvert.load_model("tiny-llama", dtype="bfloat16")
    assert load_reader(again, layer)[0].out_features == 8 == own[0].out_features  # its own file first
    assert load_reader(lminvert.load_model("tiny-llama", dtype="float16"), layer)[0].out_features == 16


def test_the_preparation_makes_every_reading_map_and_a_quick_network_once(isolated_cache, monkeypatch, tmp_path):
    """``models --prepare``'s inversion part: the reading map at every layer (from one forward: the same maps each
    layer builds alone), a quick network at the last layer (used by inversion, second to a ``--reader`` one), and no
    network trained again the second time."""
    small = Preparation(deep=1, network={"text": 0, "random": 24, "length": 8, "epochs": 1, "hidden": 16}, check=4)
    model = lminvert.load_model("tiny-llama")
    first, last = model.probe.layer(1), model.probe.layer(model.probe.n_layers)
    # the network reads the held-out prompts better than the map (the gate itself: the next test)
    monkeypatch.setattr(preparation, "held_out_ranks", lambda m, weights, p, s, **kw: [0] if callable(weights) else [9])
    given: dict = {}
    train = preparation.train_readers
    spy = lambda m, layers, **kw: given.update(kw) or train(m, layers, **kw)  # noqa: E731
    monkeypatch.setattr(preparation, "train_readers", spy)
    made = prepare(model, small, progress=False)
    # the network also trains on the maps' prompts, their states taken from the maps' forward (one forward for both),
    # and they count in its prompts: the maps' random-id prompts stand for its own 24
    maps_prompts = reading.training_prompts(model)
    assert given["extra"][0] == maps_prompts and len(given["extra"][1]) == len(maps_prompts)
    assert given["random"] == 0 and given["text"] == 0 and given["hidden"] == 16
    assert [line.split(" (")[0].split(":")[0] for line in made] == [
        "reading maps at layers 1-2",
        "KV read-back maps at 1 of blocks 2-2",
        "quick reading network at layer 2 kept",
        "quick reading networks trained and checked",
        "layer 2's reading network lent to 1 of layers 1-1, where it reads held-out prompts better than their maps",
        "first-position table at layer 2",
        "position-1 maps and calibrations at layers 1-2 and final",
        "the fused source's weights at layers 1-2 and final",
    ]
    assert table_path(model, last, "table").is_file() and not table_path(model, first, "table").is_file()
    kinds = (("position1-map", None), (calibration_kind(model), "cpu"))  # every layer's, made in one pass each
    final = model.probe.final  # the final layer's too: its first prompt would otherwise make them
    assert all(
        table_path(model, layer, kind, device).is_file() for layer in (first, last, final) for kind, device in kinds
    )
    from lminvert.invert import fusion  # the fused source's weight for each layer's reading, fitted in one pass

    assert all(
        table_path(model, layer, fusion._kind(model, reading_for(model, layer))).is_file()
        for layer in (first, last, final)
    )
    alone = measure(model, first, calibration_prompts(model))  # what layer 1 measures alone, bit for bit
    with model.probe.always_packed():
        packed = measure(model, first, calibration_prompts(model))
    radii = calibrate(lminvert.load_model("tiny-llama"), first)
    assert (radii.cached, radii.plain, radii.gap) == (
        max(alone.cached, packed.cached),
        max(alone.plain, packed.plain),
        min(alone.gap, packed.gap),
    )
    assert all(table_path(model, layer, "reading-map").is_file() for layer in model.probe.layers("all"))
    assert table_path(model, last, QUICK_KIND).is_file() and not table_path(model, last, "reader").is_file()
    fresh = lminvert.load_model("tiny-llama")
    assert load_reader(fresh, last)[0].out_features == 16
    assert load_reader(fresh, first) is load_reader(fresh, last)  # lent: layer 1 reads with layer 2's network
    assert len(prepare(fresh, small, progress=False)) == 1  # the maps read back; nothing trained, checked or built
    train_reader(fresh, last, text=0, random=24, length=8, epochs=1, hidden=8, progress=False)  # what --reader makes
    again = lminvert.load_model("tiny-llama")
    assert load_reader(again, last)[0].out_features == 8  # used before the quick one, and by the layer it was lent to
    assert load_reader(again, first) is load_reader(again, last)
    shared = reading_map(fresh, first)
    back = back_map(make_view("kv", fresh, last))  # block 2's, made by the preparation from the same forward
    table_path(fresh, first, "back-map1-kv").unlink()  # a preparation stopped after the maps: the next one makes it
    resumed = lminvert.load_model("tiny-llama")
    lines = [line.split(":")[0] for line in prepare(resumed, small, progress=False)]
    assert lines == [
        "reading maps at layers 1-2",
        "KV read-back maps at 1 of blocks 2-2",
        "the fused source's weights at layers 1-2 and final",  # for the network --reader trained since: its own
    ]
    assert torch.equal(back_map(make_view("kv", resumed, last)), back)  # from the same forward, bit for bit
    monkeypatch.setenv("LMINVERT_CACHE", str(tmp_path / "alone"))
    (tmp_path / "alone" / "models").mkdir(parents=True)
    (tmp_path / "alone" / "models" / "smollm2-135m").symlink_to(isolated_cache / "models" / "smollm2-135m")
    alone = lminvert.load_model("tiny-llama")
    assert torch.equal(back_map(make_view("kv", alone, last)), back)  # built alone, with its layer's reading map
    assert torch.equal(reading_map(alone, first), shared)


def test_a_layer_whose_map_reads_better_than_the_lent_network_keeps_its_map_and_is_checked_once(
    isolated_cache, monkeypatch
):
    """The preparation lends the last layer's network only where it reads a layer's held-out prompts better than that
    layer's own map; where it does not, the layer keeps reading with its map, and the decision is kept (a second
    preparation checks nothing)."""
    model = lminvert.load_model("tiny-llama")
    first, last = model.probe.layer(1), model.probe.layer(2)
    checked = []

    def score(m, weights, prompts, states, layer):  # the network better at layer 2, the map better at layer 1
        checked.append((layer.name, callable(weights)))
        return (0.0 if layer == last else 9.0) if callable(weights) else 5.0

    monkeypatch.setattr(preparation, "_score", score)
    small = Preparation(maps=False, network={"text": 0, "random": 8, "length": 6, "epochs": 1, "hidden": 4}, check=4)
    made = prepare(model, small, progress=False)
    assert "lent to 0 of layers 1-1" in made[2] and ("1", True) in checked and ("1", False) in checked
    fresh = lminvert.load_model("tiny-llama")
    assert load_reader(fresh, last) is not None and load_reader(fresh, first) is None
    checked.clear()
    assert prepare(fresh, small, progress=False) == [] and checked == []


def test_a_quick_network_that_reads_worse_than_the_map_is_not_kept(isolated_cache):
    """Inversion reads with a network instead of the map: the preparation keeps one only where it ranks the held-out
    prompts' tokens better (here a network of 4 units after one epoch, which reads them worse)."""
    model = lminvert.load_model("tiny-llama")
    last = model.probe.layer(model.probe.n_layers)
    weak = Preparation(maps=False, network={"text": 0, "random": 8, "length": 6, "epochs": 1, "hidden": 4}, check=8)
    made = prepare(model, weak, progress=False)
    assert made[0].startswith("quick reading network at layer 2 not kept (mean log2(2 + rank) ")
    network, linear = (float(x) for x in re.findall(r"(\d+\.\d+)", made[0]))
    assert network >= linear
    assert not table_path(model, last, QUICK_KIND).is_file()
    assert load_reader(lminvert.load_model("tiny-llama"), last) is None


def test_the_final_layer_reads_with_the_last_blocks_network_through_the_final_norm(isolated_cache):
    """A final state divided by the final norm's gain has the last block's direction: the last block's network reads
    the final layer's states as it reads the last block's (a random network kept as the preparation keeps one)."""
    from lminvert.invert.reader import QUICK_KIND, _network, keep, reading_for
    from lminvert.invert.reading import read

    model = lminvert.load_model("tiny-llama")
    probe = model.probe
    last, final = probe.layer(probe.n_layers), probe.layer("final")
    torch.manual_seed(0)
    net = _network(2 * probe.hidden_size + 1, 32, probe.hidden_size).eval()
    keep(model, last, net, QUICK_KIND)
    model = lminvert.load_model("tiny-llama")  # a fresh process: the network read from the cache
    ids = torch.tensor([5, 900, 31, 7])
    states = probe.states(ids, [last, final])
    at_final = read(reading_for(model, final), states[final][0].float())
    at_last = read(reading_for(model, last), states[last][0].float())
    assert torch.allclose(at_final, at_last, rtol=1e-3, atol=1e-4)
