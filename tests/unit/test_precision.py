"""Precision: measured acceptance radii, exact inversion in bfloat16 and float16, dtype from the file, mismatches."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.tables import first_position_table
from lminvert.invert.tolerance import FLOOR, KIND, SAFETY, calibrate, calibration_prompts, measure
from lminvert.models.halfmath import HalfAsFloat32

from ..conftest import FAMILIES

IDS = [17, 4021, 33000, 17, 5, 912, 48000]


@pytest.fixture(scope="module")
def models():
    return {dtype: lminvert.load_model("tiny-llama", dtype=dtype) for dtype in ("float32", "bfloat16", "float16")}


def test_radius_is_the_measured_disagreement_times_the_safety_factor(models):
    for dtype, model in models.items():
        layer = model.probe.layer(2)
        found = calibrate(model, layer)
        assert found.samples >= 36 and found.cached > 0 and found.plain >= 0
        target = torch.ones(64)
        assert found.radius(target) == pytest.approx(SAFETY * max(found.cached, FLOOR) * 8.0)
        assert found.confirm_radius(target) == pytest.approx(SAFETY * max(found.plain, FLOOR) * 8.0)
        assert found.scaled(3.0).radius(target) == pytest.approx(3 * found.radius(target))
        # cached on disk: a new object of the same weights reads the same measurement
        again = calibrate(lminvert.load_model("tiny-llama", dtype=dtype), layer)
        assert again.cached == found.cached and again.plain == found.plain
    rel = {dtype: calibrate(m, m.probe.layer(2)).cached for dtype, m in models.items()}
    assert rel["float32"] < 1e-5 < rel["float16"] < 1e-1 and rel["float32"] < rel["bfloat16"] < 1e-1


def test_measured_radius_covers_held_out_prompts_and_excludes_other_tokens(models):
    """The calibration prompts are not the ones inverted: the radius must hold on prompts it never saw."""
    for dtype, model in models.items():
        probe, layer = model.probe, model.probe.layer(2)
        found = calibrate(model, layer)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, probe.vocab_size, (10,), generator=gen).tolist()
        observed = encode(model, [ids], layer).states[0]
        prefix = probe.prefix([], layer)
        for t, token in enumerate(ids):
            others = torch.randint(0, probe.vocab_size, (64,), generator=gen)
            states = probe.continuation(prefix, token_ids=torch.cat([torch.tensor([token]), others])).float()
            dist = (states - observed[t]).norm(dim=1)
            radius = found.radius(observed[t])
            assert dist[0] <= radius / 2, (dtype, t)  # the true token: well inside the measured ball
            assert (dist[1:][others != token] > radius).all(), (dtype, t)  # other tokens: outside
            prefix = probe.extend(prefix, token)


def test_measure_is_what_calibrate_caches(models):
    model = models["bfloat16"]
    layer = model.probe.layer(1)
    prompts = calibration_prompts(model)
    again = measure(model, layer, prompts)
    with model.probe.always_packed():  # calibrate keeps the larger disagreement of the two paths
        packed = measure(model, layer, prompts)
    cached = calibrate(model, layer)
    assert max(again.cached, packed.cached) == pytest.approx(cached.cached)
    assert max(again.plain, packed.plain) == pytest.approx(cached.plain)


def test_calibration_sees_the_batch_sizes_of_a_scaled_device(models, monkeypatch):
    """Where policies verify 16x larger batches (a GPU), the calibration measures a batch that large too, and is
    cached apart from the CPU-sized one."""
    from lminvert.invert import context, tolerance

    model = models["float32"]
    layer = model.probe.layer(1)
    small = calibrate(model, layer)
    assert tolerance._batch_shapes(model.probe.device) == (7, 31, 127, 0)
    monkeypatch.setitem(context.BATCH_SCALE, "cpu", 16)
    assert max(tolerance._batch_shapes(model.probe.device)) == 1023
    large = calibrate(model, layer)  # measured with the large batch, kept apart from the CPU-sized measurement
    assert large.samples == small.samples and large.cached > 0
    kinds = {key[0] for key in model.memo if key[1] == int(layer)}
    assert {tolerance.KIND, f"{tolerance.KIND}-b1024"} <= kinds
    sizes = []
    real = tolerance.measure
    spy = lambda *a, **k: sizes.append(tolerance._batch_shapes(model.probe.device)) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(tolerance, "measure", spy)
    measured = tolerance.measure(model, layer, tolerance.calibration_prompts(model))
    assert sizes == [(7, 31, 127, 0, 1023)] and measured.samples == large.samples


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_half_precision_inversion_is_exact_on_every_family(name, dtype):
    model = lminvert.load_model(name, dtype=dtype)
    states = encode(model, [IDS], 2)
    assert states.dtype == dtype
    (result,) = invert(model, states, first_table=False)
    assert result.token_ids == IDS
    assert result.uncertain_positions == []
    assert result.dtype == dtype


def _plain_rows(probe, ids: list[int]) -> list[int]:
    """Every position's confirmation of ``ids`` at layer 2 by the observer-shaped plain forward, each asserted equal
    to the whole forward's bits; the starts the forwards ran from (0: the whole sequence)."""
    layer = probe.layer(2)
    whole = probe.states(torch.tensor([ids]), [layer])[layer][0]
    kept, starts = None, []
    for t in range(len(ids)):
        rows = probe.plain_states([ids], layer, upto=t, kept=kept, stop=t + 2)
        assert torch.equal(rows.states[0], whole[rows.start : rows.start + rows.states.shape[1]])
        assert rows.start + rows.states.shape[1] > t
        starts.append(rows.start)
        kept = rows.keys_of(0)
    return starts


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_forwards_from_kept_keys_equal_the_whole_forward_on_every_family(name):
    """The confirmation's plain forward started from kept keys and values (:mod:`lminvert.models.observed`) gives the
    whole forward's bits in every family, bfloat16 on this CPU: where the shortcut would not (a sequence longer than a
    sliding window, a non-sdpa attention, a differing bit at its first use) the whole sequence runs instead. Within
    every window (tiny Gemma-3's 512; tiny Mistral's 4 with 4 tokens) the shortcut runs."""
    probe = lminvert.load_model(name, dtype="bfloat16").probe
    starts = _plain_rows(probe, IDS)
    window = probe._observed.window
    whole = name == "tiny-gemma2" or (window is not None and len(IDS) > window)  # Gemma-2: eager attention
    assert name != "tiny-mistral" or whole  # its 4-token window is shorter than the 7 tokens
    assert (max(starts) == 0) is whole
    assert probe._observed.works is (False if name == "tiny-gemma2" else None if whole else True)
    if window is not None and window < len(IDS) and probe._observed.works is not False:
        assert max(_plain_rows(probe, IDS[:window])) > 0  # a sequence within the window takes it


def test_ambiguity_is_resolved_by_the_plain_forward_not_guessed():
    """A ball so wide that many candidates lie inside: the plain forward re-measures them and picks the right one."""
    model = lminvert.load_model("tiny-qwen2")
    states = encode(model, [IDS[:5]], 2)
    found = calibrate(model, model.probe.layer(2))
    scale = 1.2 / (SAFETY * max(found.cached, found.plain, FLOOR))  # both balls: 1.2x the state's norm
    (wide,) = invert(model, states, tolerance_scale=scale, first_table=False, scout=False)  # confirmations alone
    assert wide.token_ids == IDS[:5] and wide.uncertain_positions == []
    assert sum(p.confirmed for p in wide.positions) > len(IDS[:5])  # several contenders re-measured per position
    assert all(p.plain_distance is not None and p.plain_distance <= p.confirm_tolerance for p in wide.positions)


def test_dtype_mismatch_is_refused_naming_dtype(models):
    states = encode(models["bfloat16"], [IDS[:3]], 1)
    with pytest.raises(LminvertError, match="--dtype bfloat16"):
        invert(models["float32"], states)
    with pytest.raises(LminvertError, match="--dtype float32"):
        invert(models["float16"], encode(models["float32"], [IDS[:3]], 1))
    # a half-precision array carries its dtype too
    half = encode(models["float32"], [IDS[:3]], 1).states[0].to(torch.float16)
    with pytest.raises(LminvertError, match="--dtype float16"):
        invert(models["float32"], half, layer=1)


def test_cli_takes_the_dtype_from_the_file_and_refuses_a_forced_mismatch(cli, tmp):
    path = tmp / "s.safetensors"
    cli("encode", "--model", "tiny-gpt2", "--dtype", "bfloat16", "--device", "cpu", "--layer", "2", "--text",
        "Secret: 1234", "--out", str(path), "--keep-ids", check=True)  # fmt: skip
    proc = cli("invert", str(path), "--json", "--device", "cpu", check=True)
    (doc,) = json.loads(proc.stdout)
    assert doc["dtype"] == "bfloat16" and doc["device"] == "cpu" and doc["uncertain_positions"] == []
    assert doc["token_ids"] == list(lminvert.HiddenStates.load(path).token_ids[0])
    proc = cli("invert", str(path), "--dtype", "float32")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--dtype bfloat16" in proc.stderr


def test_half_linear_as_float32_matches_the_native_kernel():
    """Inside HalfAsFloat32 a half model's linear layers (nn.Linear, transformers' Conv1D) compute float32 GEMMs of
    the same operands rounded back: nearly always the native half kernel's bits, the rest one rounding step apart;
    weights converted once and again after an in-place edit; outside (and after nested blocks) the native kernel."""
    from transformers.pytorch_utils import Conv1D

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(64, 96, generator=gen).to(dtype)
        linear = torch.nn.Linear(96, 128).to(dtype)
        conv = Conv1D(128, 96).to(dtype)
        with torch.no_grad():
            conv.bias.normal_(generator=gen)
        model = torch.nn.ModuleDict({"linear": linear, "conv": conv})
        wrapper = conv.forward  # an instance forward another library put there is kept
        conv.forward = wrapper
        native = [linear(x), conv(x)]
        mode = HalfAsFloat32(model, dtype)
        with torch.no_grad(), mode:
            with mode:  # nested: still emulated after the inner block
                pass
            emulated = [linear(x), conv(x)]
            again = [linear(x), conv(x)]
            linear.weight.mul_(2)  # an in-place edit of the weights is seen
            doubled = linear(x)
        assert len(mode._copies) == 4 and "forward" not in linear.__dict__  # weight and bias of each; unpatched
        assert conv.__dict__["forward"] is wrapper
        reference = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        torch.testing.assert_close(doubled.float(), reference, rtol=2e-2, atol=5e-2)
        with torch.no_grad():
            assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))  # outside: the native kernel
        for e, a, n in zip(emulated, again, native, strict=True):
            assert e.dtype == dtype and e.shape == n.shape and torch.equal(e, a)
            assert (e == n).float().mean() > 0.99
            torch.testing.assert_close(e.float(), n.float(), rtol=2e-2, atol=2e-2)


def test_tables_written_by_one_object_are_read_by_another_and_dtypes_keep_their_own(isolated_cache):
    cache = isolated_cache
    writer = lminvert.load_model("tiny-gpt2")
    layer = writer.probe.layer(1)
    built = first_position_table(writer, layer, progress=False)
    reader = lminvert.load_model("tiny-gpt2")  # a new object: nothing in memory, the file is read
    read = first_position_table(reader, layer, progress=False)
    assert torch.equal(read, built) and read.device == reader.device and read.dtype == torch.float32
    half = lminvert.load_model("tiny-gpt2", dtype="bfloat16")
    own = first_position_table(half, layer, progress=False)
    assert own.dtype == torch.float32 and not torch.equal(own, built)  # its own table, from its own forwards
    assert (own - built).norm(dim=1).max() < 0.05 * built.norm(dim=1).min()
    calibrate(writer, layer)
    names = sorted(p.name for p in (cache / "tables").iterdir())
    assert any("float32-layer1.safetensors" in n for n in names) and any("bfloat16-layer1." in n for n in names)
    assert any(n.endswith(f"float32-layer1-{KIND}-cpu.safetensors") for n in names)  # per device type


def test_a_hooked_model_keeps_its_tables_and_radii_off_the_disk(tmp_path, monkeypatch):
    """Forward hooks change what the weights compute; the weights hash cannot tell, so nothing goes to the cache."""
    monkeypatch.setenv("LMINVERT_CACHE", str(tmp_path))
    model = lminvert.load_model("tiny-llama")
    model.probe.blocks[0].register_forward_hook(
        lambda m, a, out: (out[0] * 1.5, *out[1:]) if isinstance(out, tuple) else out * 1.5
    )
    layer = model.probe.layer(1)
    calibrate(model, layer)
    first_position_table(model, layer, progress=False)
    assert not (tmp_path / "tables").exists() or not any((tmp_path / "tables").iterdir())
    ids = [5, 900, 31000]
    (result,) = invert(model, encode(model, [ids], layer))
    assert result.token_ids == ids and result.uncertain_positions == []


@pytest.mark.parametrize(("gap", "perturbed"), [(0.05, False), (1e-12, False), (1e-12, True)])
def test_a_radius_wider_than_the_gap_needs_a_decisive_match(models, monkeypatch, gap, perturbed):
    """Where the measured radii are wider than the smallest gap between tokens' states (half precision at deep
    layers), the first match inside the ball is not taken on trust: every acceptance is confirmed by the plain
    forward, and one that does not reproduce the observation within half the gap is flagged (with every position
    after it). The plain forward is shaped like the observer's, so it reproduces the true token's state bit for bit
    (passes even an impossible gap); states it cannot reproduce exactly (perturbed by 1e-5 of their norm) are
    flagged under that gap, from the first position on."""
    from lminvert.invert import engine
    from lminvert.invert.tolerance import Calibration

    model = models["float32"]
    wide = Calibration(cached=0.3, plain=0.3, gap=gap, samples=1)
    monkeypatch.setattr(engine, "calibrate", lambda model, layer: wide)
    ids = IDS[:5]
    states = encode(model, [ids], 2)
    if perturbed:
        gen = torch.Generator().manual_seed(0)
        h = states.states[0]
        push = F.normalize(torch.randn(h.shape, generator=gen), dim=-1)
        states = dataclasses.replace(states, states=(h + 1e-5 * h.norm(dim=-1, keepdim=True) * push,))
    (result,) = invert(model, states)
    assert result.token_ids == ids
    assert all(p.confirmed >= 1 for p in result.positions)  # no acceptance without the plain forward
    if not perturbed:
        assert result.uncertain_positions == []
        assert all(p.plain_distance == 0 for p in result.positions)
    else:
        assert result.uncertain_positions == list(range(len(ids)))
        assert all(p.plain_distance > 0 for p in result.positions)


class _WrongFirst:
    """A policy that proposes a wrong token first at every position after the first, then the right one."""

    name = "wrong-first"
    uses_first_table = uses_next_tokens = uses_reading = False

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def prepare(self, model, layer, first_table=True, reading=None) -> None: ...
    def begin_prompt(self, states, readings=None) -> None: ...
    def end_position(self, ctx) -> None: ...
    def accepted(self, position, token_id) -> None: ...

    def propose(self, ctx):
        right = self.ids[ctx.position]
        order = [right] if ctx.position == 0 else [(right + 1) % ctx.probe.vocab_size, right]
        return torch.tensor(order[len(ctx.ids) :][:1], dtype=torch.long) if len(ctx.ids) < len(order) else None


@pytest.mark.parametrize("reproduced", [True, False])
def test_a_match_that_is_not_decisive_sends_the_search_on_where_the_observer_is_reproduced(
    models, monkeypatch, reproduced
):
    """A radius wider than everything (every candidate a contender) and a policy that proposes a wrong token first:
    where earlier positions were reproduced bit for bit, the wrong token's inexact reproduction does not end the
    search, the right one (verified next) is found and nothing is flagged. Where the observation is not reproduced
    (perturbed states by 1e-3), the first contender is kept and flagged, with every position after it: never
    certain."""
    from lminvert.invert import engine
    from lminvert.invert.tolerance import Calibration

    model = models["float32"]
    monkeypatch.setattr(engine, "calibrate", lambda model, layer: Calibration(10.0, 10.0, 0.05, 1))
    ids = IDS[:4]
    states = encode(model, [ids], 2).states[0]
    if not reproduced:
        states = states * (1 + 1e-3)
    result = engine.invert_prompt(model, states, model.probe.layer(2), policy=_WrongFirst(ids))
    if reproduced:
        assert result.token_ids == ids and result.uncertain_positions == []
    else:  # position 0 is within half the gap (1e-3 of the norm): certain; the wrong token at 1 ends its search
        assert result.token_ids[0] == ids[0] and result.token_ids[1] != ids[1]
        assert result.uncertain_positions == list(range(1, len(ids)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_half_model_computes_what_transformers_loads_in_that_dtype(name, dtype, tmp_path):
    """lminvert's half model is the one a user runs (``from_pretrained(..., dtype=...)``), bit for bit at every
    position: its buffers (a rotary embedding's frequencies, float32 there) are not rounded by the cast, so a
    capture made that way can be reproduced (SmolLM2 in bfloat16: block 15's keys up to 0.42 off after position 0)."""
    model = lminvert.load_model(name)
    model.model.save_pretrained(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).eval()
    ours = lminvert.load_model(str(tmp_path), dtype=dtype).model
    ids = torch.randint(0, model.probe.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = (m(ids, output_hidden_states=True).hidden_states for m in (theirs, ours))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
