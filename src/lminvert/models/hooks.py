"""The layer probe's forwards over part of the blocks: one read at chosen blocks that runs no block above the highest
one asked for (:func:`forward_layers`), and one whose blocks below a layer hand on given states (:func:`final_from`).

Both run transformers' own forward of the model, so every family's own embeddings, positions, masks, caches and final
norm apply, and nothing is raised to end a forward early. The first cuts the block list after the last block it needs
for the call (:func:`through_block`; cutting from the top keeps every block's index, which some families use to pick
a block's mask); the second keeps the lower blocks in place and makes them hand on the given states. Every hook, cut
or replaced ``forward`` is undone when the forward ends, whatever happens. ``probe`` is a :class:`.probe.LayerProbe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from .hf_internals import Cache
from .layers import Layer


@contextlib.contextmanager
def through_block(probe, stop: int) -> Iterator[None]:
    """Within: the base model's block list holds its first ``stop`` blocks only (each at its own index); the full
    list is put back on leaving. A forward then runs exactly those blocks between the model's own embedding and final
    norm (the mapping check compares such a forward with transformers' whole one: :mod:`.discovery`)."""
    if stop == probe.n_layers:  # every block runs: nothing to cut (most forwards of a layer near the top)
        yield
        return
    *path, name = probe.blocks_name.split(".")
    owner = probe.base
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, probe.blocks[:stop])  # a new list over the same blocks: the probe's own list is kept
    try:
        yield
    finally:
        setattr(owner, name, probe.blocks)


def _output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def forward_layers(probe, layers: Iterable[Layer], whole: bool = False, **kwargs) -> dict[Layer, torch.Tensor]:
    """Run the probe's base model on ``kwargs`` through the highest requested (resolved) layer's block only and
    capture the requested layers: layer ``l >= 1`` as block ``l``'s output, layer 0 as the first block's input
    (the state the model's final norm receives where no block runs), ``final`` as the base model's output.

    ``whole``: run the whole model instead (LM head included, no block left out; the final layer read at the final
    norm's output): the sequential baseline times what the reference code runs."""
    wanted = sorted(set(layers))
    captured: dict[int, torch.Tensor] = {}
    top = probe.n_layers if whole or probe.final in wanted else int(wanted[-1])
    handles = []

    def read(layer: int):
        def hook(module, args, output):
            captured[layer] = _output(output)

        return hook

    def read_input(module, args, kw):
        captured[0] = args[0] if args else kw["hidden_states"]

    if 0 in wanted:
        first = probe.blocks[0] if top > 0 else probe.final_norm
        if first is not None:
            handles.append(first.register_forward_pre_hook(read_input, with_kwargs=True))
    for layer in wanted:
        if 1 <= layer <= probe.n_layers:
            handles.append(probe.blocks[layer - 1].register_forward_hook(read(layer)))
    if whole and probe.final in wanted:
        handles.append(probe.final_norm.register_forward_hook(read(probe.final)))
    try:
        with through_block(probe, top):
            if whole:
                probe.model(**kwargs)
            else:
                out = probe.base(**kwargs).last_hidden_state
                if probe.final in wanted:
                    captured[probe.final] = out
                if top == 0:  # no block ran: the output is the input where no final norm read it
                    captured.setdefault(0, out)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: captured[layer] for layer in wanted}


def final_from(
    probe, states: torch.Tensor, resolved: Layer, cache: Cache | None = None, upper: Layer | None = None
) -> torch.Tensor:
    """The last hidden state ``[B, T, d]`` of sequences whose layer-``resolved`` states are ``states`` (the body of
    :meth:`.probe.LayerProbe.final_from`, whose docstring states the contract). ``cache``: the KV cache of the
    sequences' earlier positions in every block, where the blocks below ``resolved`` are skipped (a ValueError
    elsewhere: they would run on placeholders and cache their keys): ``states`` are the next positions', the blocks
    above ``resolved`` attend to the cache and add their keys and values to it, the blocks below leave it as it is.
    ``upper``: a block layer above ``resolved`` whose states to return instead (the blocks above it do not run)."""
    states = states.to(device=probe.device, dtype=probe.dtype)
    if states.dim() == 2:
        states = states[None]
    if upper is not None and (upper.is_final or int(upper) <= int(resolved) or resolved.is_final):
        raise ValueError(f"layer {upper} is not a block layer above layer {resolved}")
    if resolved.is_final:
        return states
    if int(resolved) == probe.n_layers:
        return states if probe.final_norm is None else probe.final_norm(states)
    captured: list[torch.Tensor] = []
    top = None
    if upper is not None:
        top = probe.blocks[int(upper) - 1].register_forward_hook(lambda m, a, output: captured.append(_output(output)))
    placeholder = torch.zeros(states.shape[:2], dtype=torch.long, device=probe.device)
    try:  # it only orders candidates: a half model's GEMMs may run as float32 ones here (:mod:`.halfmath`)
        with (
            _handed_on(probe, states, resolved, cache is not None),
            torch.no_grad(),
            probe._cached_math(),
            through_block(probe, probe.n_layers if upper is None else int(upper)),
        ):
            cached = {"use_cache": False} if cache is None else {"past_key_values": cache, "use_cache": True}
            last = probe.base(input_ids=placeholder, **cached).last_hidden_state
            return last if upper is None else captured[-1]
    finally:
        if top is not None:
            top.remove()


@contextlib.contextmanager
def _handed_on(probe, states: torch.Tensor, resolved: Layer, skip: bool) -> Iterator[None]:
    """Within: the blocks below ``resolved`` hand on ``states`` (skipped where the mapping check saw blocks return
    plain tensors; elsewhere a hook replaces the input of block 1, or the output of block ``resolved``). ``skip``: they
    must be skipped (a ValueError where they cannot)."""

    def pre_hook(module, args, kw):
        if args:
            return (states, *args[1:]), kw
        return args, {**kw, "hidden_states": states}

    def hook(module, args, output):
        return (states, *output[1:]) if isinstance(output, tuple) else states

    below = probe.blocks[: int(resolved)]
    skipped = probe._blocks_return_tensors and int(resolved) > 0
    if skip and not skipped:
        raise ValueError(f"the blocks below layer {resolved} cannot be skipped: give no cache")
    kept = []
    if int(resolved) == 0:
        handle = probe.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    elif skipped:  # an instance attribute: nn.Module calls it instead of the class's (one already there is kept)
        handle = None
        kept = [block.__dict__.get("forward") for block in below]
        for block in below:
            block.forward = lambda *args, **kwargs: states
    else:
        handle = probe.blocks[int(resolved) - 1].register_forward_hook(hook)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        if skipped:
            for block, forward in zip(below, kept, strict=True):
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward
