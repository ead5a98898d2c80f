"""Reading the files a KV cache is saved in (:mod:`lminvert.kv_captures` builds on it): ``torch.load`` with only
transformers' cache classes allowed (:func:`_load`: a pickled cache is rebuilt without running its code; anything else
pickled is a one-line error saying how to save plain tensors), and the names that pair key and value tensors by block
(:func:`_groups`: ``past_key_values.3.key``, ``layers.3.keys``, ``k_3``/``v_3``, ``key_cache.3``, ``.3.0``/``.3.1``)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .captures import _natural, generated_steps
from .errors import LminvertError

CACHE_CLASSES = (  # transformers.cache_utils classes a saved cache may pickle: plain attribute holders
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "StaticSlidingWindowLayer",
)


KEY_WORDS = frozenset({"k", "key", "keys"})


VALUE_WORDS = frozenset({"v", "value", "values"})


SAVE_HINT = "torch.save([(l.keys, l.values) for l in cache.layers], path)"


_TOKEN = re.compile(r"[a-z]+|\d+")


_PAIR_TAIL = re.compile(r"(\d+)[._/-]([01])$")  # past_key_values.3.0 / .3.1: a (keys, values) pair flattened


def _safe_classes() -> list[type]:
    from transformers import cache_utils

    return [cls for name in CACHE_CLASSES if (cls := getattr(cache_utils, name, None)) is not None]


def _torch_load(path: Path, mmap: bool) -> Any:
    with torch.serialization.safe_globals(_safe_classes()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _unsafe_globals(path: Path) -> list[str]:
    try:
        listed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: nothing to list
        return []
    allowed = {f"transformers.cache_utils.{name}" for name in CACHE_CLASSES}
    return [name for name in listed if name not in allowed]


def _load(path: Path) -> Any:
    if not path.is_file():
        raise LminvertError(f"KV cache file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            return dict(load_file(str(path)))
        if suffix == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        return _torch_load(path, mmap=False)
    except pickle.UnpicklingError as exc:
        refused = ", ".join(_unsafe_globals(path)[:4])
        if not refused:  # not a checkpoint torch can list the classes of: a damaged or foreign file
            raise _unreadable(path, exc) from exc
        raise LminvertError(
            f"cannot load {path.name} safely: it pickles {refused}, and torch.load(weights_only=True) allows only "
            f"tensors and transformers' cache classes; save plain tensors instead: {SAVE_HINT}"
        ) from exc
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError) as exc:
        raise _unreadable(path, exc) from exc
    except Exception as exc:  # the safe unpickler's other refusals (a class rebuilt from a mismatched state, ...)
        raise LminvertError(
            f"cannot load {path.name} with torch.load(weights_only=True) ({type(exc).__name__}): save plain tensors "
            f"instead: {SAVE_HINT}"
        ) from exc


def _unreadable(path: Path, exc: Exception) -> LminvertError:
    return LminvertError(
        f"cannot read {path.name} ({type(exc).__name__}): save the cache with torch.save(out.past_key_values, path) "
        f"or {SAVE_HINT}"
    )


def _role(name: str) -> tuple[str, int | None] | None:
    """Whether entry ``name`` holds keys (``"k"``) or values (``"v"``), and the block index in its name."""
    lower = name.lower()
    tokens = _TOKEN.findall(lower)
    roles = [i for i, t in enumerate(tokens) if t in KEY_WORDS | VALUE_WORDS]
    if not roles:
        return None
    tail = _PAIR_TAIL.search(lower)
    if tail and sum(t.isdigit() for t in tokens[roles[-1] + 1 :]) >= 2:
        return ("k" if tail[2] == "0" else "v"), int(tail[1])
    numbers = [int(t) for t in tokens if t.isdigit()]
    return ("k" if tokens[roles[-1]] in KEY_WORDS else "v"), (numbers[-1] if numbers else None)


def _groups(names: list[str]) -> dict[int | None, dict[str, list[str]]]:
    groups: dict[int | None, dict[str, list[str]]] = {}
    for name in sorted(names, key=_natural):
        found = _role(name)
        if found is not None:
            role, index = found
            groups.setdefault(index, {}).setdefault(role, []).append(name)
    return groups


def _has_pair(names: list[str]) -> bool:
    return any(len(group) == 2 for group in _groups(names).values())


def _check_groups(path: Path, groups: dict[int | None, dict[str, list[str]]]) -> None:
    """One keys entry and one values entry per index, else a one-line error."""
    word = {"k": "keys", "v": "values"}
    for index, group in groups.items():
        where = "the unnumbered entries" if index is None else f"index {index}"
        for role, names in group.items():
            if len(names) > 1:
                raise LminvertError(
                    f"{path.name}: {', '.join(names)} all read as the {word[role]} of {where}: pick one set with "
                    "--key PREFIX"
                )
        if len(group) == 1:
            ((role, (name,)),) = group.items()
            other = word["v" if role == "k" else "k"]
            raise LminvertError(
                f"{path.name}: entry '{name}' holds {word[role]} with no matching {other} at {where}: save both, "
                "named alike (e.g. k_3 and v_3)"
            )


def _held(entry: Any) -> int | None:
    """How many positions a block's entry (a ``(keys, values)`` pair or a cache layer) stores, where it says."""
    keys = entry[0] if isinstance(entry, (list, tuple)) else getattr(entry, "keys", None)
    return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else None


def windowed(entries: dict[Any, Any]) -> dict[int, tuple[int, int]]:
    """The numbered blocks that store fewer positions than the most any block stores: ``block -> (held, most)``.
    In one forward's cache every block stores every position but a sliding-window layer's, which keeps only its last
    ``window - 1`` (transformers' ``DynamicSlidingWindowLayer``): such a block's rows are the end of the prompt, not
    its first positions, and cannot be read as a prompt."""
    held = {n: h for n, e in entries.items() if n is not None and (h := _held(e)) is not None}
    most = max(held.values(), default=0)
    return {n: (h, most) for n, h in held.items() if h < most}


def _is_cache(value: Any) -> bool:
    layers = getattr(value, "layers", None)
    if isinstance(layers, (list, tuple)):
        return bool(layers) and all(
            not isinstance(layer, dict) and hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers
        )
    return isinstance(getattr(value, "key_cache", None), list) and isinstance(getattr(value, "value_cache", None), list)


def _is_pairs(value: Any) -> bool:
    if not isinstance(value, (list, tuple)) or not value or generated_steps(value):
        return False
    return all(
        isinstance(p, (list, tuple)) and len(p) >= 2 and all(isinstance(t, torch.Tensor) for t in p[:2]) for p in value
    )


def _is_one_pair(value: Any) -> bool:
    """One block's ``(keys, values)``: two 4-D tensors of one shape (``[batch, kv_heads, T, head_dim]``)."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in value)
        and value[0].shape == value[1].shape
    )


def _looks_kv(loaded: Any) -> bool:
    if _is_cache(loaded) or _is_pairs(loaded) or _is_one_pair(loaded):
        return True
    if not isinstance(loaded, dict):
        return False
    if any(_is_cache(v) or _is_pairs(v) for v in loaded.values()):
        return True
    return _has_pair([str(k) for k, v in loaded.items() if isinstance(v, torch.Tensor)])
