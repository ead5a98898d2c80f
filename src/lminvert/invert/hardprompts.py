"""HardPrompts (PEZ, Wen et al. 2023) as an inversion baseline, the way the paper compares against it.

Continuous input vectors for all T positions are optimised jointly against the whole observed state matrix at
one layer. At every step they are projected to their nearest vocabulary rows (cosine similarity, as PEZ's
``nn_project``); the loss and its gradient are taken at the projected (hard) point and applied to the continuous
vectors, with AdamW, for a fixed number of steps. The answer is the projected sequence with the lowest loss seen.
No candidate is ever verified exactly: the method has no notion of "found".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models import LayerSpec, LoadedModel


@dataclass(frozen=True)
class HardPromptsResult:
    token_ids: list[int]
    seconds: float
    steps: int
    best_loss: float  # relative squared error of the best projected sequence's states


def _nearest_rows(x: torch.Tensor, unit_vocab: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.normalize(x, dim=-1) @ unit_vocab.T).argmax(dim=-1)


def hard_prompts(
    model: LoadedModel,
    states: torch.Tensor,
    layer: LayerSpec,
    steps: int = 1000,
    lr: float = 0.1,
    weight_decay: float = 0.1,
    seed: int = 0,
) -> HardPromptsResult:
    """Recover a prompt from ``states`` ``[T, d]`` at ``layer`` with PEZ (``steps`` AdamW steps, PEZ's defaults)."""
    probe = model.probe
    layer = probe.layer(layer)
    target = states.to(device=probe.device, dtype=torch.float32)
    vocab = probe.vocab_matrix().float()
    unit_vocab = torch.nn.functional.normalize(vocab, dim=-1)
    generator = torch.Generator().manual_seed(seed)
    start_ids = torch.randint(0, len(vocab), (target.shape[0],), generator=generator).to(vocab.device)
    soft = vocab[start_ids].clone().requires_grad_(True)
    optimiser = torch.optim.AdamW([soft], lr=lr, weight_decay=weight_decay)
    scale = target.square().sum()
    best_ids, best_loss = start_ids, float("inf")
    start = time.perf_counter()
    for _ in range(steps):
        with torch.no_grad():
            ids = _nearest_rows(soft, unit_vocab)
        hard = vocab[ids].clone().requires_grad_(True)
        out = probe.embeds_states(hard, layer)[layer][0].float()
        loss = (out - target).square().sum() / scale
        (grad,) = torch.autograd.grad(loss, hard)
        value = float(loss.detach())
        if value < best_loss:
            best_loss, best_ids = value, ids
        optimiser.zero_grad()
        soft.grad = grad
        optimiser.step()
    return HardPromptsResult([int(t) for t in best_ids], time.perf_counter() - start, steps, best_loss)
