"""The sequential baseline: SIPIT the way the paper's released code runs it, to compare lminvert against.

Public (``lminvert.invert.baseline.sequential_baseline``) so that any speed-up lminvert reports can be
measured again against it, on the same machine, in the same process (``benchmarks/bench_invert.py`` does).

One candidate at a time: a gradient step on a continuous input vector at position t, then the nearest
not-yet-tried vocabulary entry is checked by a full forward of prefix + candidate through the whole model
(no KV cache, no early stop, all hidden states returned). Exact but slow; lminvert's engine must beat it.
Acceptance uses the engine's measured radius for a plain forward (:mod:`.tolerance`), so both solve the same
problem. Everything runs on the model's device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models import Layer, LayerSpec, LoadedModel
from .tolerance import calibrate


@dataclass(frozen=True)
class BaselineResult:
    token_ids: list[int]
    seconds: float
    candidates_checked: list[int]
    complete: bool  # False when the time limit stopped it


def _layer_state(model: LoadedModel, embeds: torch.Tensor, layer: Layer) -> torch.Tensor:
    """State of the last position at ``layer`` from a full, uncached forward of the whole model (LM head
    included, as the reference code does); the layer is read with a hook so its semantics match the probe."""
    probe = model.probe
    captured: list[torch.Tensor] = []
    if layer.is_final:
        handle = probe.final_norm.register_forward_hook(lambda m, args, out: captured.append(out))
    elif layer == 0:
        handle = probe.blocks[0].register_forward_pre_hook(
            lambda m, args, kw: captured.append(args[0] if args else kw["hidden_states"]), with_kwargs=True
        )
    else:
        handle = probe.blocks[layer - 1].register_forward_hook(
            lambda m, args, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
    try:
        model.model(inputs_embeds=embeds[None], use_cache=False)
    finally:
        handle.remove()
    return captured[0][0, -1]


def sequential_baseline(
    model: LoadedModel,
    states: torch.Tensor,
    layer: LayerSpec,
    lr: float = 0.1,
    time_limit: float | None = None,
    known: list[int] | None = None,
) -> BaselineResult:
    """Invert ``states`` [T, d] one candidate per gradient step, with full uncached forwards.

    ``known`` gives the first tokens (their states are skipped), e.g. to time ordinary positions without the
    first position's attention sink.
    """
    probe = model.probe
    layer = probe.layer(layer)
    device = probe.device
    calibration = calibrate(model, layer)
    vocab = probe.vocab_matrix(torch.float32)
    embed = probe.embed
    recovered: list[int] = list(known or [])
    checked: list[int] = []
    start = time.perf_counter()
    for t in range(len(recovered), states.shape[0]):
        target = states[t].to(device=device, dtype=torch.float32)
        tol = calibration.confirm_radius(target)
        prefix = embed(torch.tensor(recovered, dtype=torch.long, device=device)).detach() if recovered else None
        x = vocab.mean(0).clone().requires_grad_(True)
        opt = torch.optim.SGD([x], lr=lr)
        tried = torch.zeros(len(vocab), dtype=torch.bool, device=device)
        found = None
        count = 0
        while found is None and count < len(vocab):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                return BaselineResult(recovered[len(known or []) :], time.perf_counter() - start, checked, False)
            # gradient step: full forward + backward through the whole model
            opt.zero_grad()
            seq = x[None] if prefix is None else torch.cat([prefix, x[None]])
            loss = (_layer_state(model, seq.to(probe.dtype), layer).float() - target).square().sum()
            loss = loss / target.square().sum()
            loss.backward()
            opt.step()
            with torch.no_grad():
                dist = (vocab - x.detach()).norm(dim=1)
                dist[tried] = float("inf")
                cand = int(dist.argmin())
                tried[cand] = True
                count += 1
                seq = embed(torch.tensor([*recovered, cand], device=device))
                state = _layer_state(model, seq, layer).float()
                if float((state - target).norm()) <= tol:
                    found = cand
        recovered.append(found if found is not None else cand)
        checked.append(count)
    return BaselineResult(recovered[len(known or []) :], time.perf_counter() - start, checked, True)
