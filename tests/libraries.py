"""States captured the way users of other libraries capture them (nnsight, TransformerLens), for the tests that
check lminvert reads them. Each runs on its own copy of the model's weights: the libraries add hooks to the module
they wrap, and TransformerLens' compatibility mode rewrites its weights."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch


def nnsight_states(model, ids: list[int], block: int) -> torch.Tensor:
    """``model.model.layers[block].output`` saved inside an nnsight trace: ``[T, d]``."""
    nnsight = pytest.importorskip("nnsight.modeling.transformers")
    lm = nnsight.TransformersModel(copy.deepcopy(model.model), task="text-generation", tokenizer=model.tokenizer)
    with lm.trace(torch.tensor([ids])):
        saved = lm.model.layers[block].output.save()
    saved = saved[0] if isinstance(saved, tuple) else saved
    return saved[0].detach().clone()


def transformer_lens_cache(model, ids: list[int], compatibility: bool = False) -> dict[str, torch.Tensor]:
    """A TransformerLens 4 ``TransformerBridge`` cache of one prompt (raw hook names; ``compatibility``: after
    ``enable_compatibility_mode()``), each entry ``[T, ...]``."""
    bridge_module = pytest.importorskip("transformer_lens.model_bridge")
    with tempfile.TemporaryDirectory() as folder:
        model.model.config.save_pretrained(folder)  # the bridge reads the architecture from a config
        bridge = bridge_module.TransformerBridge.boot_transformers(
            folder, hf_model=copy.deepcopy(model.model), tokenizer=model.tokenizer
        )
    if compatibility:
        bridge.enable_compatibility_mode()
    _, cache = bridge.run_with_cache(torch.tensor([ids]))
    names = [name for name in cache.keys() if name.endswith("hook_resid_post")]  # noqa: SIM118 (a cache, not a dict)
    return {name: cache[name][0].detach().clone() for name in names}
