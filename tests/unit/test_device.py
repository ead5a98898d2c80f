"""Devices on a machine without a GPU: names resolve or fail in one line, every model-loading command takes --device,
and the inversion's tensors follow the model's device (exercised on the CPU; tests/unit/test_cuda.py does CUDA)."""

from __future__ import annotations

import pytest
import torch

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.tables import first_position_table, position1_projection
from lminvert.models.loading import resolve_device

COMMANDS = ["encode", "invert", "collisions", "exhaustive", "demo"]  # every command that loads a model


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    for bad in ("tpu", "gpu0", "cuda:x"):
        with pytest.raises(LminvertError, match="--device"):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(cli, tmp):
    with pytest.raises(LminvertError, match="--device cpu"):
        lminvert.load_model("tiny-llama", device="cuda")
    proc = cli("encode", "--model", "tiny-llama", "--layer", "1", "--text", "hi", "--device", "cuda:1",
               "--out", str(tmp / "s.safetensors"))  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--device" in proc.stderr
    assert not (tmp / "s.safetensors").exists()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_a_one_line_error():
    with pytest.raises(LminvertError, match="MPS is not available"):
        resolve_device("mps")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_model_loading_command_takes_device_and_dtype(cli, command):
    proc = cli(command, "--help", check=True)
    assert "--device" in proc.stdout and "--dtype" in proc.stdout


def test_everything_the_engine_makes_lives_on_the_models_device():
    model = lminvert.load_model("tiny-llama", device="auto")
    layer = model.probe.layer(2)
    assert model.describe()["device"] == str(model.device)
    assert first_position_table(model, layer, progress=False).device == model.device
    assert all(t.device == model.device for t in position1_projection(model, layer))
    states = encode(model, [[5, 900, 31000]], layer)
    assert states.states[0].device.type == "cpu"  # states files always hold CPU float32 tensors
    (result,) = invert(model, states)
    assert result.token_ids == [5, 900, 31000] and result.device == str(model.device)
