"""States as people capture them: whatever a notebook or a deployment saved, read as one ``[T, d]`` tensor per prompt.

Accepted (:meth:`lminvert.states.HiddenStates.load` comes here for all but states files from ``lminvert encode``):

* ``.npy``: one array ``[T, d]``, ``[1, T, d]`` or ``[N, T, d]``; ``.npz`` (``numpy.savez``): its arrays as entries;
* ``.pt``/``.pth`` (``torch.save``, read with ``weights_only``): a tensor as above, a list or tuple of ``[T, d]``
  tensors (one per prompt; ``[1, T, d]`` ones too where their lengths differ), a tuple of tensors of one shape
  ``[N, T, d]`` (``output_hidden_states``: one entry per layer), ``generate()``'s hidden states (a tuple per step of a
  tuple per layer: the first step's, the prompt's, are read), or a dict (an nnsight ``.save()`` gathered into one, a
  TransformerLens cache's entries);
* ``.safetensors`` with any key names, among them vLLM's hidden-state files (its ``extract_hidden_states`` method
  with ``ExampleHiddenStatesConnector``): ``hidden_states`` ``[K, T, d]``, one ``[T, d]`` slice per entry of
  ``eagle_aux_hidden_state_layer_ids``, beside the prompt's ``token_ids``; its slices are the entries
  ``hidden_states.0`` .. ``hidden_states.{K-1}`` (``key`` picks one where K > 1).

A list or dict with several candidate entries is ambiguous (``output_hidden_states`` is one tensor per layer; a
TransformerLens cache holds every hook): ``key`` picks one, by name or by index; in a file of one array (``np.save`` or
``torch.save`` of ``torch.stack(output_hidden_states)``, ``[layers, N, T, d]``), ``key`` = ``I`` is its slice ``I``
along the first axis. An entry named ``attention_mask`` or ``mask`` beside the states is the batch's attention mask. Pad
rows are dropped, with a note: the rows such a mask (or a ``mask`` file) marks 0, else runs of two or more *identical*
rows at a prompt's start or end (left padding always gives them; right padding does where the pads' positions do not
advance). One pad row alone, or right padding whose pad rows differ, needs the mask.

Layer numbering (``library_layer``): lminvert's layer ``l`` is the residual stream after block ``l`` (0: the
embeddings; ``final``: after the final norm). transformers' ``hidden_states[i]`` is layer ``i`` except the last
(``i = L``), which is ``final``; nnsight's ``model.model.layers[i].output`` and TransformerLens'
``blocks.{i}.hook_resid_post`` are layer ``i + 1`` (``blocks.{i}.hook_resid_pre``: layer ``i``); vLLM's layer id ``i``
(the input of its decoder layer ``i``; ``L``: the last block's output, before the final norm) is layer ``i``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import LminvertError

MASK_KEYS = ("attention_mask", "mask")
LIBRARIES = ("lminvert", "hf", "nnsight", "tl", "vllm")
VLLM_KEYS = ("hidden_states", "token_ids")  # what a vLLM hidden-state file holds, and nothing else
PAD_RUN = 2  # identical rows in a run at a prompt's start or end that are taken for pads (two real positions never
# share a state: the model is injective, and a position's state depends on its position)


def read_capture(
    path: Path, key: str | None = None, mask: str | Path | None = None
) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """The states saved in ``path`` (see the module docstring), one tensor per prompt with its pad rows dropped, and
    notes saying what was read and dropped."""
    entries, notes = _entries(path)
    notes += _vllm(entries)
    given_mask = _read_mask(Path(mask)) if mask is not None else None
    saved_mask = next((entries.pop(k) for k in MASK_KEYS if k in entries), None)
    name, value = _pick(path, entries, key)
    states = _as_prompts(path, value)
    if name is not None:
        notes.append(f"read entry '{name}' of {path.name}")
    mask_tensor = given_mask if given_mask is not None else saved_mask
    if mask_tensor is not None:
        states, dropped = _apply_mask(states, mask_tensor)
        notes.append(f"dropped {dropped} row(s) the attention mask marks as padding")
    else:
        states, dropped = _drop_identical(states)
        if dropped:
            notes.append(
                f"dropped {dropped} pad row(s): runs of identical rows at a prompt's start or end (--mask to say which)"
            )
    return states, tuple(notes)


def _entries(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The file's entries by name ("" for a file of one tensor or of a list of prompts) and notes on how they were
    read."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return {"": torch.from_numpy(np.load(path, allow_pickle=False))}, []
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as arrays:
                return {name: torch.from_numpy(arrays[name]) for name in arrays.files}, []
        if suffix == ".safetensors":
            return dict(load_file(str(path))), []
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError, KeyError) as exc:
        raise LminvertError(
            f"cannot read {path.name} ({type(exc).__name__}); give a [T, d] or [N, T, d] float array, a list or a dict "
            "of them"
        ) from exc
    except Exception as exc:  # torch.load's unpickler refuses arbitrary objects with its own exception types
        raise LminvertError(
            f"cannot read {path.name} with torch.load(weights_only=True) ({type(exc).__name__}): save plain tensors "
            "(e.g. torch.save(h.cpu(), path)), a list or a dict of them"
        ) from exc
    if isinstance(loaded, dict):
        return {str(k): v for k, v in loaded.items()}, []
    if generated_steps(loaded):
        note = f"generate()'s hidden states: the first of {len(loaded)} steps read (the prompt's), one entry per layer"
        return {str(i): v for i, v in enumerate(loaded[0])}, [note]
    if isinstance(loaded, (list, tuple)):
        if _one_per_prompt(loaded):
            return {"": list(loaded)}, []
        return {str(i): v for i, v in enumerate(loaded)}, []
    return {"": loaded}, []


def generated_steps(value: Any) -> bool:
    """Whether ``value`` is ``generate(..., output_hidden_states=True, return_dict_in_generate=True).hidden_states``:
    a tuple per step (the prompt's, then one per generated token) of a tuple per layer (three or more) of ``[B, T,
    d]`` tensors, one ``d``."""
    if not isinstance(value, (list, tuple)) or not value or not isinstance(value[0], (list, tuple)):
        return False
    steps = [s for s in value if isinstance(s, (list, tuple)) and len(s) == len(value[0]) >= 3]
    tensors = [t for s in steps for t in s if isinstance(t, torch.Tensor) and t.dim() == 3]
    return (
        len(steps) == len(value)
        and len(tensors) == len(value) * len(value[0])
        and len({t.shape[-1] for t in tensors}) == 1
    )


def _one_per_prompt(value: list | tuple) -> bool:
    """A list of ``[T, d]`` tensors, one per prompt, or of ``[1, T, d]`` ones whose lengths differ (several of one
    shape are ``output_hidden_states``' layers, each a batch: read as entries, not as prompts)."""
    if not value or not all(isinstance(t, torch.Tensor) and (t.dim() == 2 or t.shape[:1] == (1,)) for t in value):
        return False
    batched = [t for t in value if t.dim() == 3]
    return len(batched) < 2 or len({t.shape for t in batched}) > 1


def _vllm(entries: dict[str, Any]) -> list[str]:
    """Split a vLLM hidden-state file's ``[K, T, d]`` into its K layers' entries (in place); the note saying so."""
    states, ids = (entries.get(k) for k in VLLM_KEYS)
    if set(entries) != set(VLLM_KEYS) or not _is_states(states) or states.dim() != 3:
        return []
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() != states.shape[1]:
        return []
    del entries["hidden_states"], entries["token_ids"]
    entries |= {f"hidden_states.{k}": s for k, s in enumerate(states)}
    return [
        f"a vLLM hidden-state file: {len(states)} layer(s) of one {states.shape[1]}-token prompt, whose token ids it "
        "also holds in plain text"
    ]


def _pick(path: Path, entries: dict[str, Any], key: str | None) -> tuple[str | None, Any]:
    """The entry holding the states: ``key``'s, else the only floating-point one."""
    if key is not None:
        sliced = _slice(entries, key)
        if sliced is not None:
            return sliced
        if key not in entries:
            listed = ", ".join(sorted(entries, key=_natural)[:12]) or "none"
            raise LminvertError(f"{path.name} has no entry '{key}': its entries are {listed}")
        return key, entries[key]
    if len(entries) == 1:  # the only entry: what is wrong with it is said by the shape checks
        ((name, value),) = entries.items()
        return (name or None), value
    floats = {k: v for k, v in entries.items() if _is_states(v)}
    if len(floats) == 1:
        ((name, value),) = floats.items()
        return (name or None), value
    if not floats:
        raise LminvertError(f"{path.name} holds no floating-point [T, d] or [N, T, d] tensor: is it a states file?")
    if sorted(floats, key=_natural) == [str(i) for i in range(len(floats))]:  # a tuple per layer (output_hidden_states)
        raise LminvertError(
            f"{path.name} holds {len(floats)} tensors, one per layer as output_hidden_states gives them: "
            f"{pick_layer(len(floats))}"
        )
    listed = ", ".join(sorted(floats, key=_natural)[:12])
    raise LminvertError(
        f"{path.name} holds {len(floats)} tensors ({listed}{', ...' if len(floats) > 12 else ''}): pick the states "
        "with --key NAME (e.g. one layer of output_hidden_states: see --source-library)"
    )


def pick_layer(layers: int) -> str:
    """How to pick one of ``layers`` states saved one per layer (transformers' ``output_hidden_states``)."""
    return (
        "pick one with --key I (transformers' hidden_states[I] is lminvert's layer I, the last is final), e.g. --key "
        f"{layers // 2}"
    )


def _slice(entries: dict[str, Any], key: str) -> tuple[str, Any] | None:
    """A file of one array ``[K, ...]`` (no names): ``key`` = ``I`` picks its slice ``I`` along the first axis (one
    layer of a stack, ``torch.stack(output_hidden_states)``, or one prompt of a batch); None where that is not the
    case."""
    value = entries.get("") if len(entries) == 1 else None
    if not isinstance(value, torch.Tensor) or value.dim() < 3 or not key.lstrip("-").isdigit():
        return None
    index = int(key)
    if not -len(value) <= index < len(value):
        raise LminvertError(
            f"--key {key}: the file's array {list(value.shape)} has {len(value)} slices (0..{len(value) - 1})"
        )
    return f"[{index}]", value[index]


def _is_states(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_is_states(v) for v in value)
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() in (2, 3)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _as_prompts(path: Path, value: Any) -> list[torch.Tensor]:
    if isinstance(value, list):
        return [t.detach() if t.dim() == 2 else _one(path, t) for t in value]
    if not isinstance(value, torch.Tensor):
        raise LminvertError(f"{path.name}: the states entry is a {type(value).__name__}, not a tensor")
    if not value.is_floating_point():
        raise LminvertError(f"states must be floating point, got {value.dtype}")
    if value.dim() == 1:  # one vector (a last-position leak)
        return [value.detach()[None]]
    if value.dim() == 2:
        return [value.detach()]
    if value.dim() == 3:
        return [p.detach() for p in value]
    if value.dim() == 4:
        raise LminvertError(
            f"states must have shape [d], [T, d] or [N, T, d], got {list(value.shape)}: one layer of a stack "
            f"(torch.stack(output_hidden_states), [layers, batch, T, d]) is --key I (e.g. --key {len(value) // 2}); a "
            "KV cache's [batch, heads, T, head_dim] is --leak kv"
        )
    raise LminvertError(f"states must have shape [d], [T, d] or [N, T, d], got {list(value.shape)}")


def _one(path: Path, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() != 3 or tensor.shape[0] != 1:
        raise LminvertError(f"{path.name}: a list entry must be [T, d] or [1, T, d], got {list(tensor.shape)}")
    return tensor[0].detach()


def _read_mask(path: Path) -> torch.Tensor:
    if not path.is_file():
        raise LminvertError(f"mask file not found: {path}")
    entries, _ = _entries(path)
    named = next((entries[k] for k in (*MASK_KEYS, "") if k in entries), None)
    if named is None and len(entries) == 1:
        named = next(iter(entries.values()))
    if not isinstance(named, torch.Tensor) or named.dim() not in (1, 2):
        raise LminvertError(f"{path.name}: a mask must be one [N, T] or [T] tensor of 0/1")
    return named


def _apply_mask(states: list[torch.Tensor], mask: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    mask = mask.reshape(1, -1) if mask.dim() == 1 else mask
    lengths = [len(s) for s in states]
    if mask.shape[0] != len(states) or any(mask.shape[1] != n for n in lengths):
        raise LminvertError(
            f"the mask has shape {list(mask.shape)} but the states hold {len(states)} prompt(s) of "
            f"{sorted(set(lengths))} rows: give the batch's attention mask, [N, T]"
        )
    keep = mask.bool()
    if not keep.any(1).all():
        raise LminvertError("the mask keeps no row of some prompt: is it the attention mask of these states?")
    return [s[k] for s, k in zip(states, keep, strict=True)], int((~keep).sum())


def _drop_identical(states: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    spans = [pad_span(s) for s in states]
    dropped = sum(len(s) - (stop - start) for s, (start, stop) in zip(states, spans, strict=True))
    return [s[start:stop] for s, (start, stop) in zip(states, spans, strict=True)], dropped


def pad_span(rows: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)``: one prompt's rows (states, or a KV cache's) less runs of ``PAD_RUN`` or more identical rows
    at its start and end, taken for pads (every row where all are identical or there are too few to hold pads and a
    prompt)."""
    if len(rows) < PAD_RUN + 1:  # too short to hold pads and a prompt (an empty one is refused by HiddenStates)
        return 0, len(rows)
    start, stop = 0, len(rows)
    lead = _run(rows)
    if lead >= PAD_RUN:
        start = lead
    trail = _run(rows.flip(0))
    if trail >= PAD_RUN and len(rows) - trail > start:
        stop = len(rows) - trail
    if stop - start < 1:  # every row identical: nothing to tell pads from the prompt
        return 0, len(rows)
    return start, stop


def _run(rows: torch.Tensor) -> int:
    """How many rows from the first are identical to it."""
    same = (rows == rows[0]).all(1)
    return int(same.long().cumprod(0).sum())


def library_layer(index: str, library: str, n_layers: int) -> str:
    """lminvert's name of layer ``index`` as ``library`` numbers it (see the module docstring)."""
    if library not in LIBRARIES:
        raise LminvertError(f"unknown --source-library '{library}': use one of {', '.join(LIBRARIES)}")
    if library in ("lminvert", "vllm"):  # vLLM's layer ids count as lminvert's layers do
        return index
    try:
        i = int(index)
    except ValueError:
        raise LminvertError(
            f"--layer {index} with --source-library {library}: give the library's integer index"
        ) from None
    if library == "hf":
        if not -(n_layers + 1) <= i <= n_layers:
            raise LminvertError(f"hidden_states has indices 0..{n_layers} for this model, not {i}")
        i %= n_layers + 1
        return "final" if i == n_layers else str(i)
    if not 0 <= i < n_layers:
        raise LminvertError(f"{library} numbers this model's blocks 0..{n_layers - 1}, not {i}")
    return str(i + 1)
