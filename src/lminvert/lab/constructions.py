"""Models built to break injectivity on purpose, and their analytic contrasts (used by `lminvert lab break`).

Each construction edits a transformers model in place, with forward hooks on its blocks or edits to its weights,
so the layer probe, the collision search and the inversion engine run on it unchanged:

* ``tie_rows``: copy one token's embedding row onto another (tied parameters);
* ``hard_step``: every block's output replaced by the Heaviside step of it (a discretised, non-analytic residual);
* ``quantise_activations``: every block's output fake-quantised to ``bits`` bits on a static grid (symmetric,
  its range calibrated per block as the largest absolute activation over calibration prompts);
* ``indistinct_positions``: GPT-2 with its position table zeroed and its attention output projections zeroed, so
  no position sees any other and none knows where it is.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from lminvert.models.probe import LayerProbe


def _replace_output(fn):
    """A forward hook applying ``fn`` to a block's hidden states (a tensor, or the first item of a tuple)."""

    def hook(module: nn.Module, args, output):
        if isinstance(output, tuple):
            return (fn(output[0]), *output[1:])
        return fn(output)

    return hook


def hard_step(model: PreTrainedModel) -> PreTrainedModel:
    """Block outputs become ``1[h > 0]``: every state is a binary vector."""
    for block in LayerProbe(model).blocks:
        block.register_forward_hook(_replace_output(lambda h: (h > 0).to(h.dtype)))
    return model


def fake_quantise(h: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    """Symmetric static quantisation to ``bits`` bits on the fixed grid ``clip / (2^(bits-1) - 1) * k``,
    returned dequantised (values beyond ``±clip`` saturate)."""
    levels = 2 ** (bits - 1) - 1
    step = clip / levels
    return torch.clamp(torch.round(h / step), -levels, levels) * step


def quantise_activations(model: PreTrainedModel, bits: int, clips: list[float]) -> PreTrainedModel:
    """Every block's output fake-quantised to ``bits`` bits with a static per-block range ``clips[i]`` (as in
    static W8A8 schemes, calibrated once): what the next block and the probe see."""
    for block, clip in zip(LayerProbe(model).blocks, clips, strict=True):
        block.register_forward_hook(_replace_output(lambda h, clip=clip: fake_quantise(h, bits, clip)))
    return model


def tie_rows(model: PreTrainedModel, source: int, target: int) -> PreTrainedModel:
    """Token ``target``'s input embedding row becomes a bit-identical copy of ``source``'s."""
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight[target] = weight[source]
    return model


def indistinct_positions(model: PreTrainedModel) -> PreTrainedModel:
    """GPT-2 without positional information and with every attention output projection zeroed."""
    if model.config.model_type != "gpt2":
        raise ValueError("indistinct_positions edits a GPT-2 model (its learned position table)")
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
    return model
