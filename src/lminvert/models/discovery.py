"""Where an architecture keeps its blocks and final norm, and the check that the layer probe maps them right.

The layer probe (:mod:`.probe`) finds a model's transformer blocks and final norm here when it is made, then
compares what it reads with transformers' own ``output_hidden_states`` (:func:`check_mapping`): a model whose blocks
or final norm were mapped wrongly gets a one-line error, never a wrong layer. A new architecture whose blocks or
final norm are kept under other names is taught here (:func:`_find_blocks`, :func:`_find_final_norm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import LminvertError

BLOCK_NAMES = ("layers", "h", "blocks")
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def _foreign(hook: object) -> bool:
    """A hook someone added (not one transformers installs itself, e.g. to capture outputs: those read, not edit)."""
    return not getattr(hook, "__module__", "").startswith("transformers.")


def has_hooks(model: nn.Module) -> bool:
    """Whether forward hooks other than transformers' own are registered on any module of ``model`` (the probe's own
    are removed after use): they may change what the weights compute, which neither the weights hash nor
    transformers' hidden states show, and injectivity cannot be assumed of what they compute."""
    return any(
        _foreign(hook)
        for m in model.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks)
        for hook in hooks.values()
    )


def _owners(base: nn.Module) -> list[nn.Module]:
    """Where a base model keeps its blocks and final norm: itself, or its ``decoder`` (OPT)."""
    decoder = getattr(base, "decoder", None)
    return [base] + ([decoder] if isinstance(decoder, nn.Module) else [])


def _find_blocks(base: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    for owner in _owners(base):
        for name in BLOCK_NAMES:
            blocks = getattr(owner, name, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks) == n_layers:
                return ("decoder." if owner is not base else "") + name, blocks
    found = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(found) == 1:
        return found[0]
    raise LminvertError(
        f"cannot find the {n_layers} transformer blocks of {type(base).__name__}: no ModuleList named "
        f"{', '.join(BLOCK_NAMES)} with {n_layers} entries"
        + (f" and {len(found)} other candidates" if found else " and no other one")
        + "; this architecture is not supported yet (teach lminvert.models.discovery._find_blocks)"
    )


def _find_final_norm(base: nn.Module) -> nn.Module | None:
    for owner in _owners(base):
        for name in NORM_NAMES:
            module = getattr(owner, name, None)
            if isinstance(module, nn.Module):
                return module
    return None


def check_mapping(probe) -> None:
    """Compare ``probe`` (a :class:`.probe.LayerProbe`) with transformers' own ``output_hidden_states`` on two tokens
    (one small forward): a model whose blocks or final norm were mapped wrongly gets a one-line error here, never a
    wrong layer, and so does one whose forward cut after block 1 (or before block 0, :func:`.hooks.through_block`)
    reads other states than the whole forward. Records on the probe whether its blocks return plain tensors
    (``_blocks_return_tensors``).

    Skipped for a model with forward hooks (e.g. one whose block outputs are replaced on purpose): transformers
    records hidden states before such hooks act, the probe reads what the next block receives."""
    if has_hooks(probe.model):
        return
    name = type(probe.model).__name__
    ids = torch.tensor([[0, min(1, probe.vocab_size - 1)]], device=probe.device)
    outputs: list[object] = []
    handle = probe.blocks[0].register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        with torch.no_grad():
            ref = probe.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()
    probe._blocks_return_tensors = bool(outputs) and all(isinstance(o, torch.Tensor) for o in outputs)
    if ref is None or len(ref) != probe.n_layers + 1:
        raise LminvertError(f"{name} does not return {probe.n_layers + 1} hidden states: cannot map its layers")
    try:
        ours = probe.states(ids, [*range(probe.n_layers + 1), "final"])
    except KeyError:
        raise LminvertError(
            f"the blocks found in {name} ('{probe.blocks_name}') do not run in its forward: cannot map its "
            "layers (teach lminvert.models.discovery._find_blocks)"
        ) from None

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a.float() - b.float()).norm() <= 1e-2 * b.float().norm() + 1e-6)

    for layer in range(probe.n_layers):
        if not same(ours[layer], ref[layer]):
            raise LminvertError(
                f"layer {layer} read from '{probe.blocks_name}' of {name} is not transformers' hidden_states"
                f"[{layer}]: cannot map this architecture (teach lminvert.models.discovery._find_blocks)"
            )
    last = ours[probe.n_layers]
    if not same(last, ref[-1]):  # the model's last hidden state is normalised: by the norm found, or unknown
        if probe.final_norm is None:
            raise LminvertError(
                f"cannot find the final norm of {name} (looked for {', '.join(NORM_NAMES)}): its last hidden state "
                "is normalised by a module lminvert does not know (teach lminvert.models.discovery._find_final_norm)"
            )
        if not same(probe.final_norm(last), ref[-1]):
            raise LminvertError(
                f"the final norm found in {name} does not give transformers' last hidden state: cannot map 'final'"
            )
    _check_cut(probe, ids, ref, same)


def _check_cut(probe, ids: torch.Tensor, ref: tuple[torch.Tensor, ...], same: Callable) -> None:
    """Forwards cut after block 1 and before block 0 (:func:`.hooks.through_block`) read transformers' own states."""
    name = type(probe.model).__name__
    for layer in sorted({0, min(1, probe.n_layers - 1)}):
        try:
            cut = probe.states(ids, layer)[probe.layer(layer)]
        except Exception as error:  # a family whose forward needs every block: a one-line error, not a traceback
            cut, reason = None, f" ({type(error).__name__}: {error})"
        if cut is None or not same(cut, ref[layer]):
            raise LminvertError(
                f"{name} run through block {layer} only does not give transformers' hidden_states[{layer}]"
                f"{reason if cut is None else ''}: cannot stop its forward early (teach "
                "lminvert.models.hooks.through_block)"
            )
