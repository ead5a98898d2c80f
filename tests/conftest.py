from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # `make test` runs the suite in several processes: they share the cores, none oversubscribes them
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

TINY = ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-gemma3"]  # the core four: every unit test runs on them
FAMILIES = [  # every causal-LM family lminvert is tested on: parity with transformers and inversion
    *TINY,
    "tiny-mistral",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-phi3",
    "tiny-pythia",
    "tiny-opt",
]


def small_vocab_llama():
    """A random Llama with a 300-token vocabulary (no tokenizer), tokens 5 and 9 sharing an embedding row."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[9] = model.get_input_embeddings().weight[5]
    return model


@pytest.fixture(scope="session")
def smollm2():
    import lminvert

    return lminvert.load_model("smollm2-135m")


def run_cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run the `lminvert` command as a user would, in this process (``lminvert.cli.main``: the same parsing, exit
    status, stdout and stderr as ``python -m lminvert``, without a new interpreter importing torch for each call);
    what the command logs reaches its stderr as the command's own logging set-up would send it."""
    from lminvert.cli import main

    out, err = io.StringIO(), io.StringIO()
    verbose = "-v" in args or "--verbose" in args
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level, handler.level) if level else handler.level)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help, usage errors
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    proc = subprocess.CompletedProcess(["lminvert", *args], code, out.getvalue(), err.getvalue())
    if check and proc.returncode != 0:
        raise AssertionError(f"lminvert {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def empty_cache(root: Path) -> Path:
    """``root`` made an empty lminvert cache (tables, radii, readers) that still reaches the converted SmolLM2 (whose
    tokenizer the tiny models borrow); set ``LMINVERT_CACHE`` to it to use it."""
    (root / "models").mkdir(parents=True)
    real = Path(os.environ.get("LMINVERT_CACHE") or Path.home() / ".cache" / "lminvert")
    (root / "models" / "smollm2-135m").symlink_to(real / "models" / "smollm2-135m")
    return root


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """An :func:`empty_cache` for one test."""
    root = empty_cache(tmp_path / "cache")
    monkeypatch.setenv("LMINVERT_CACHE", str(root))
    return root
