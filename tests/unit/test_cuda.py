"""On a CUDA GPU: encode -> invert at the first, middle and last layer, float32 and bfloat16, a tiny model and
SmolLM2; several prompts together; tables written on the CPU read on the GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import lminvert
from lminvert.forward import encode
from lminvert.invert import invert
from lminvert.invert.tables import first_position_table, position1_projection
from lminvert.invert.tolerance import calibrate

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA GPU visible to this torch ({torch.__version__}); run this module on a CUDA machine",
)

IDS = [17, 4021, 33000, 17, 5, 912]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer", ["1", "middle", "-1"])
def test_tiny_model_on_cuda(dtype, layer):
    model = lminvert.load_model("tiny-llama", dtype=dtype, device="cuda")
    assert model.device.type == "cuda"
    states = encode(model, [IDS, IDS[:3]], layer)
    results = invert(model, states)
    assert [r.token_ids for r in results] == [IDS, IDS[:3]]
    assert all(r.uncertain_positions == [] and r.device.startswith("cuda") for r in results)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer", [1, 15, 30])
def test_smollm2_on_cuda(dtype, layer):
    model = lminvert.load_model("smollm2-135m", dtype=dtype, device="cuda")
    text = model.tokenize("Contact Jane Doe at jane.doe@example.com about invoice 4471.")[:12]
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(0, model.probe.vocab_size, (8,), generator=gen).tolist()
    results = invert(model, encode(model, [text, rand], layer))
    assert [r.token_ids for r in results] == [text, rand]
    assert all(r.uncertain_positions == [] for r in results)


def test_tables_written_on_cpu_are_read_on_cuda():
    cpu = lminvert.load_model("tiny-gpt2")
    layer = cpu.probe.layer(1)
    table = first_position_table(cpu, layer, progress=False)  # written to the cache (if not there already)
    jac = position1_projection(cpu, layer)[0]
    gpu = lminvert.load_model("tiny-gpt2", device="cuda")  # a new object: the files are read, then moved
    read = first_position_table(gpu, layer, progress=False)
    assert read.device.type == "cuda" and torch.equal(read.cpu(), table)
    assert all(t.device.type == "cuda" for t in position1_projection(gpu, layer))
    torch.testing.assert_close(position1_projection(gpu, layer)[0].cpu(), jac)
    assert calibrate(gpu, layer).samples > 0  # measured again on CUDA: its kernels round differently


def test_many_prompts_together_equal_one_at_a_time_on_cuda():
    model = lminvert.load_model("tiny-qwen2", device="cuda")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.probe.vocab_size, (n,), generator=gen).tolist() for n in (5, 2, 7)]
    states = encode(model, prompts, 2)
    one = invert(model, states, together=1)
    many = invert(model, states, together=3)
    assert [r.token_ids for r in one] == [r.token_ids for r in many] == prompts


def test_cli_on_cuda(cli, tmp):
    path = tmp / "s.safetensors"
    cli("encode", "--model", "tiny-llama", "--layer", "2", "--text", "hi there", "--dtype", "bfloat16",
        "--device", "cuda", "--out", str(path), check=True)  # fmt: skip
    proc = cli("invert", str(path), "--device", "cuda", "--json", check=True)
    assert '"device": "cuda' in proc.stdout and '"dtype": "bfloat16"' in proc.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_audit_on_cuda_claims_nothing_wrong(dtype, tmp):
    from lminvert.audit import audit

    model = lminvert.load_model("tiny-llama", dtype=dtype, device="cuda")
    defences = ["none", "noise:0.01", "quant:int8", "permute", "drop:0.25", "project:16", "noise:1"]
    doc = audit(tmp / dtype, model="tiny-llama", load=lambda name: model, quick=True, kinds=["random"],
                defences=defences, progress=False)  # fmt: skip
    rows = doc["rows"]
    assert rows and all(r["wrong_claimed"] == 0 for r in rows)
    for leak in ("states", "kv"):
        none = [r for r in rows if r["leak"] == leak and r["defence"] == "none"]
        assert none and all(r["exact"] and r["top1"] == 1.0 for r in none)
    heavy = [r for r in rows if r["defence"] == "noise:1" and r["leak"] != "last"]
    assert heavy and all(r["verdicts"]["uncertain"] == r["length"] for r in heavy)
