"""The layer probe's hooks: a forward read at chosen blocks and stopped right after the highest one asked for
(:func:`forward_layers`), and a forward whose blocks below a layer hand on given states (:func:`final_from`).

Both run transformers' own forward of the unmodified model; every hook (or replaced ``forward``) they install is
removed when the forward ends, whatever happens. ``probe`` is a :class:`.probe.LayerProbe`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .layers import Layer


class _Stop(Exception):
    """Raised by a hook to end the forward after the last block we need."""


def forward_layers(probe, layers: Iterable[Layer], whole: bool = False, **kwargs) -> dict[Layer, torch.Tensor]:
    """Run the probe's base model on ``kwargs``, capture the requested (resolved) layers, stop after the highest one.

    ``whole``: run the whole model instead (LM head included, nothing stopped; the final layer read at the final
    norm's output): the sequential baseline times what the reference code runs."""
    wanted = sorted(set(layers))
    captured: dict[int, torch.Tensor] = {}
    top = None if whole else wanted[-1]
    handles = []

    def pre_hook(module, args, kw):
        hidden = args[0] if args else kw["hidden_states"]
        captured[0] = hidden
        if top == 0:
            raise _Stop

    def make_hook(layer: int):
        def hook(module, args, output):
            captured[layer] = output[0] if isinstance(output, tuple) else output
            if layer == top:
                raise _Stop

        return hook

    if 0 in wanted:
        handles.append(probe.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
    for layer in wanted:
        if 1 <= layer <= probe.n_layers:
            handles.append(probe.blocks[layer - 1].register_forward_hook(make_hook(layer)))
    if whole and probe.final in wanted:
        handles.append(probe.final_norm.register_forward_hook(make_hook(probe.final)))
    try:
        if whole:
            probe.model(**kwargs)
        else:
            out = probe.base(**kwargs)
            if probe.final in wanted:
                captured[probe.final] = out.last_hidden_state
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return {layer: captured[layer] for layer in wanted}


def final_from(probe, states: torch.Tensor, resolved: Layer) -> torch.Tensor:
    """The last hidden state ``[B, T, d]`` of sequences whose layer-``resolved`` states are ``states`` (the body of
    :meth:`.probe.LayerProbe.final_from`, whose docstring states the contract)."""
    states = states.to(device=probe.device, dtype=probe.dtype)
    if states.dim() == 2:
        states = states[None]
    if resolved.is_final:
        return states
    if int(resolved) == probe.n_layers:
        return states if probe.final_norm is None else probe.final_norm(states)

    def pre_hook(module, args, kw):
        if args:
            return (states, *args[1:]), kw
        return args, {**kw, "hidden_states": states}

    def hook(module, args, output):
        return (states, *output[1:]) if isinstance(output, tuple) else states

    below = probe.blocks[: int(resolved)]
    skipped = probe._blocks_return_tensors and int(resolved) > 0
    if int(resolved) == 0:
        handle = probe.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    elif skipped:  # an instance attribute: nn.Module calls it instead of the class's (one already there is kept)
        handle = None
        kept = [block.__dict__.get("forward") for block in below]
        for block in below:
            block.forward = lambda *args, **kwargs: states
    else:
        handle = probe.blocks[int(resolved) - 1].register_forward_hook(hook)
    placeholder = torch.zeros(states.shape[:2], dtype=torch.long, device=probe.device)
    try:  # it only orders candidates: a half model's GEMMs may run as float32 ones here (:mod:`.halfmath`)
        with torch.no_grad(), probe._cached_math():
            return probe.base(input_ids=placeholder, use_cache=False).last_hidden_state
    finally:
        if handle is not None:
            handle.remove()
        if skipped:
            for block, forward in zip(below, kept, strict=True):
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward
