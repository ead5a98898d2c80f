"""KV caches as people save them: one block's keys and values, read as one ``[T, 2*H*hd]`` row tensor per prompt.

A row holds one position's keys of every KV head, flattened head-major, then its values the same way (the layout of
:meth:`lminvert.models.kv.KVBlock.cached`; keys are rotated by RoPE, as transformers stores them). Block ``b``
(1-based) is transformers' ``cache.layers[b-1]``, i.e. ``past_key_values[b-1]``.

Accepted (``.pt``/``.pth`` are read with ``torch.load(weights_only=True)``; of the pickled classes only
transformers' cache classes :data:`.kv_files.CACHE_CLASSES` are allowed, which are rebuilt without running their code):

* ``torch.save(out.past_key_values, path)``: a transformers ``DynamicCache`` (or ``StaticCache``, whose unused
  positions are cut off), or any cache whose ``layers`` hold ``keys``/``values`` tensors;
* a list or tuple of ``(keys, values)`` pairs, one per block (``cache.to_legacy_cache()``, or
  ``[(l.keys, l.values) for l in cache.layers]``), also as a dict entry ``past_key_values`` beside an
  ``attention_mask``; one block's pair alone (``(layer.keys, layer.values)``, two 4-D tensors of one shape);
* one block's tensors in a dict: ``keys``/``values``, ``key``/``value``, ``k``/``v``, ``key_cache``/``value_cache``
  (any case), with an optional ``attention_mask`` or ``mask``;
* ``.safetensors`` with any key names: key and value tensors are paired by the block index in their names
  (``past_key_values.3.key``, ``layers.3.keys``, ``k_3``/``v_3``, ``key_cache.3``, ``past_key_values.3.0``/``.1``),
  0-based where an index 0 exists (index ``i`` is block ``i + 1``), else 1-based; ``attention_mask`` beside them.

Each block's tensors are transformers' ``[B, H, T, hd]`` or one prompt's ``[H, T, hd]``. ``key`` picks an entry of a
dict, or the entries whose names start with it. With an attention mask ``[B, T]`` (saved beside the cache, or a
``mask`` file) each prompt keeps the rows its mask marks 1, which must be contiguous (left or right padding); its
offset is the index of its first kept row in the saved sequence. Without a mask, runs of identical rows at a prompt's
start or end are dropped as pads (``generate()`` gives pads one position); else a cache holds no sign of pads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .captures import MASK_KEYS, _is_states, _natural, _read_mask, pad_span
from .errors import LminvertError
from .kv_files import (
    SAVE_HINT,
    _check_groups,
    _groups,
    _has_pair,
    _is_cache,
    _is_one_pair,
    _is_pairs,
    _load,
    _looks_kv,
    _torch_load,
    _unsafe_globals,
    windowed,
)

CACHE_ENTRY = "past_key_values"
LAYER_HINT = "lminvert numbering: block B is transformers' cache.layers[B-1]"


@dataclass(frozen=True)
class KVCapture:
    """One block's cache rows as read from a file (see the module docstring)."""

    rows: tuple[torch.Tensor, ...]  # one [T_i, 2*H*hd] tensor per prompt, pad positions dropped, dtype as saved
    block: int | None  # lminvert's block number 1..L where the file says it (an index in a whole cache), else None
    blocks: int | None  # how many blocks the file holds (None: one block's tensors only)
    heads: int
    head_dim: int
    offsets: tuple[int, ...]  # per prompt: the index in the saved sequence of its first kept row
    notes: tuple[str, ...]  # what was read and dropped, one short sentence each

    @property
    def dtype(self) -> str:
        """The precision a model ran in to compute these rows: ``bfloat16``/``float16`` for half-precision rows, else
        ``float32``."""
        return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(self.rows[0].dtype, "float32")


@dataclass
class _Found:
    """The blocks a file holds: keyed by lminvert's block number (None: one block's tensors, unnumbered); each a
    ``(keys, values)`` pair or a cache layer."""

    entries: dict[int | None, Any]
    notes: list[str] = field(default_factory=list)


def read_kv(
    path: str | Path | Any, block: int | None = None, key: str | None = None, mask: str | Path | None = None
) -> KVCapture:
    """Block ``block``'s cache rows saved in ``path`` (see the module docstring), pads dropped by the attention mask
    saved beside them or given as the ``mask`` file. ``path`` may also be what would have been saved, still in memory
    (``out.past_key_values``, a list of (keys, values), a dict of tensors): read as its file would be."""
    if isinstance(path, str | Path):
        path = Path(path)
        loaded = _load(path)
    else:
        path, loaded = Path("the given cache"), dict(path) if isinstance(path, dict) else path  # the mask is popped
    saved_mask = _pop_mask(loaded)
    given_mask = _read_mask(Path(mask)) if mask is not None else None
    found = _find(path, loaded, key)
    number, entry = _choose(path, found, block)
    keys, values = _shaped(path, number, *_tensors(number, entry))
    rows = torch.cat([keys.transpose(1, 2).flatten(2), values.transpose(1, 2).flatten(2)], dim=-1)
    mask_tensor = given_mask if given_mask is not None else saved_mask
    prompts, offsets, dropped = _prompts(rows, keys.shape, mask_tensor)
    numbered = None not in found.entries
    return KVCapture(
        rows=tuple(prompts),
        block=number,
        blocks=len(found.entries) if numbered else None,
        heads=keys.shape[1],
        head_dim=keys.shape[3],
        offsets=offsets,
        notes=(*found.notes, *dropped),
    )


def is_kv_file(path: str | Path) -> bool:
    """Whether ``path`` looks like a saved KV cache rather than states (names and structure only; nothing checked)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                return _has_pair(list(f.keys()))
        except (SafetensorError, OSError):
            return False
    if path.suffix.lower() in (".npy", ".npz"):
        return False
    try:
        try:
            loaded = _torch_load(path, mmap=True)  # tensors mapped, not read
        except RuntimeError:  # a file torch.save wrote in its legacy format cannot be mapped
            loaded = _torch_load(path, mmap=False)
    except Exception:  # refused by the safe unpickler: a cache of another class still says so in its globals
        return any("cache_utils" in name for name in _unsafe_globals(path))
    return _looks_kv(loaded)


def _pop_mask(loaded: Any) -> torch.Tensor | None:
    """The attention mask saved beside the cache (removed from ``loaded``), if any."""
    if not isinstance(loaded, dict):
        return None
    for name in list(loaded):
        if str(name).lower() in MASK_KEYS and isinstance(loaded[name], torch.Tensor):
            return loaded.pop(name)
    return None


def _find(path: Path, loaded: Any, key: str | None) -> _Found:
    """The blocks ``loaded`` holds, with a note saying how they were read and numbered."""
    if key is not None:
        if not isinstance(loaded, dict):
            raise LminvertError(
                f"--key names an entry of a dict or safetensors file, but {path.name} holds a {type(loaded).__name__}"
            )
        loaded = _keyed(path, loaded, key)
    if _is_cache(loaded):
        return _from_cache(loaded)
    if _is_one_pair(loaded):
        return _Found({None: tuple(loaded)}, ["read one block's (keys, values) pair"])
    if _is_pairs(loaded):
        return _Found(
            dict(enumerate(loaded, start=1)),
            [f"read a list of {len(loaded)} (keys, values) pairs: block B is entry B-1"],
        )
    if isinstance(loaded, dict):
        return _from_dict(path, loaded)
    raise _not_kv(path, loaded)


def _keyed(path: Path, loaded: dict, key: str) -> Any:
    """Entry ``key`` of ``loaded``, or the entries whose names start with it."""
    if key in loaded and not isinstance(loaded[key], torch.Tensor):
        return loaded[key]
    prefix = key.lower()
    picked = {
        name: value
        for name, value in loaded.items()
        if str(name).lower() == prefix or (str(name).lower().startswith(prefix) and not str(name)[len(key)].isalnum())
    }
    if not picked:
        listed = ", ".join(sorted(map(str, loaded), key=_natural)[:12]) or "none"
        raise LminvertError(
            f"{path.name} has no entry '{key}' (nor entries starting with it): its entries are {listed}"
        )
    return picked


def _from_cache(cache: Any) -> _Found:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        layers = list(zip(cache.key_cache, cache.value_cache, strict=True))
    name = type(cache).__name__
    return _Found(
        dict(enumerate(layers, start=1)), [f"read a {name} of {len(layers)} blocks: block B is its cache.layers[B-1]"]
    )


def _from_dict(path: Path, loaded: dict) -> _Found:
    nested = {str(k): v for k, v in loaded.items() if _is_cache(v) or _is_pairs(v)}
    cache_name = next((k for k in nested if k.lower() == CACHE_ENTRY), None)
    if cache_name is None and len(nested) > 1:
        listed = ", ".join(sorted(nested, key=_natural))
        raise LminvertError(f"{path.name} holds {len(nested)} caches ({listed}): pick one with --key NAME")
    if cache_name is not None or nested:
        name = cache_name or next(iter(nested))
        found = _find(path, nested[name], None)
        found.notes.insert(0, f"read entry '{name}' of {path.name}")
        return found
    tensors = {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if not _groups(list(tensors)):
        raise _not_kv(path, loaded)
    return _from_names(path, tensors)


def _from_names(path: Path, tensors: dict[str, torch.Tensor]) -> _Found:
    """Key and value tensors paired by the block index in their names."""
    groups = _groups(list(tensors))
    _check_groups(path, groups)
    if None in groups and len(groups) > 1:
        raise LminvertError(
            f"{path.name} holds unnumbered keys and values beside numbered ones: pick with --key PREFIX"
        )
    pairs = {i: (tensors[g["k"][0]], tensors[g["v"][0]]) for i, g in groups.items()}
    used = sum(len(g) for g in groups.values())
    notes = [f"ignored {len(tensors) - used} entries that are neither keys nor values"] if len(tensors) > used else []
    if None in pairs:
        return _Found(
            pairs, [f"read one block's keys and values from {path.name}: it does not say which block", *notes]
        )
    start = 0 if 0 in pairs else 1
    shift = 1 - start
    first = min(pairs)
    convention = "0-based (an index 0 exists)" if start == 0 else "1-based (no index 0)"
    notes.insert(
        0,
        f"numbered the {len(pairs)} block(s) by the index in the entry names, {convention}: "
        f"'{groups[first]['k'][0]}' is block {first + shift}",
    )
    return _Found({i + shift: p for i, p in pairs.items()}, notes)


def _not_kv(path: Path, loaded: Any) -> LminvertError:
    values = loaded.values() if isinstance(loaded, dict) else [loaded]
    if any(_is_states(v) for v in values):
        return LminvertError(
            f"{path.name} holds no keys and values: this looks like hidden states ([T, d] or [N, T, d]): drop --leak kv"
        )
    return LminvertError(
        f"{path.name} holds no KV cache: save torch.save(out.past_key_values, path), {SAVE_HINT}, or a dict of "
        "'keys' and 'values' tensors"
    )


def _choose(path: Path, found: _Found, block: int | None) -> tuple[int | None, Any]:
    """The block ``block`` names (lminvert numbering); without one, the only one or, in a file of several, the lowest
    (the earliest block inverts fastest: block 1's rows depend on each token and its position alone), with a note in
    ``found`` that says so."""
    entries = found.entries
    if None in entries:  # one block's tensors: the caller's block is the one they came from
        return None, entries[None]
    numbers, short = sorted(entries), windowed(entries)
    span = f"{numbers[0]}..{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else str(numbers)
    whole = [n for n in numbers if n not in short]  # a sliding-window layer's block keeps the prompt's end alone
    if block is None:
        if len(numbers) > 1:
            which = "the lowest" if not short else f"the lowest that holds every position ({_windows(short)})"
            found.notes.append(
                f"{path.name} holds {len(numbers)} blocks ({span}): block {whole[0]}, {which}, was read, as "
                f"the earliest inverts fastest (pass --layer B for another; {LAYER_HINT})"
            )
        return whole[0], entries[whole[0]]
    if block not in entries:
        raise LminvertError(
            f"{path.name} holds blocks {span}, not block {block}: pass --layer B among them ({LAYER_HINT})"
        )
    if block in short:
        raise LminvertError(
            f"block {block} of {path.name} holds the last {short[block][0]} of the {short[block][1]} positions other "
            f"blocks hold (a sliding-window layer): pick one that holds them all with --layer B ({whole[:8]})"
        )
    return block, entries[block]


def _windows(short: dict[int, tuple[int, int]]) -> str:
    """The note's words on the blocks that keep only the prompt's end."""
    listed = sorted(short)
    (held, most), named = short[listed[0]], ", ".join(map(str, listed[:6])) + (", ..." if len(listed) > 6 else "")
    which = f"blocks {named} hold" if len(listed) > 1 else f"block {named} holds"
    return f"{which} only the last {held} of {most} positions: sliding windows"


def _tensors(number: int | None, entry: Any) -> tuple[Any, Any]:
    """A block's keys and values: a pair's first two entries, or a cache layer's tensors (a static layer's unused
    positions cut off)."""
    if isinstance(entry, (list, tuple)):
        return entry[0], entry[1]
    keys, values = getattr(entry, "keys", None), getattr(entry, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() < 2:
        raise LminvertError(f"block {number} of the cache is empty (no forward filled it): pick another with --layer B")
    seen = getattr(entry, "cumulative_length_int", getattr(entry, "cumulative_length", None))
    seen = keys.shape[-2] if seen is None else int(seen)
    if seen > keys.shape[-2]:
        raise LminvertError(
            f"block {number} is a sliding-window layer that kept only the last {keys.shape[-2]} of {seen} positions: "
            "pick a full-attention block with --layer B"
        )
    return keys[..., :seen, :], values[..., :seen, :]


def _shaped(path: Path, number: int | None, keys: Any, values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as ``[B, H, T, hd]``, checked."""
    where = f"{path.name}" + (f" block {number}" if number is not None else "")
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise LminvertError(f"{where}: keys and values must be tensors, got {type(keys).__name__}")
    if keys.dim() == 3 and values.dim() == 3:  # one prompt's [H, T, hd]
        keys, values = keys[None], values[None]
    shapes = f"keys {list(keys.shape)} and values {list(values.shape)}"
    if keys.dim() != 4 or values.dim() != 4:
        raise LminvertError(f"{where}: {shapes}: give transformers' [B, H, T, hd] (or one prompt's [H, T, hd])")
    if keys.shape != values.shape:
        raise LminvertError(f"{where}: {shapes} disagree: save the keys and values of the same block")
    if not keys.is_floating_point() or not values.is_floating_point():
        raise LminvertError(f"{where}: keys and values must be floating point, got {keys.dtype} and {values.dtype}")
    if keys.shape[2] == 0:
        raise LminvertError(f"{where} holds no positions (T = 0): save the cache after a forward of the prompts")
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise LminvertError(
            f"{where}: the keys or values hold NaN or inf: save the cache of a forward that did not fail"
        )
    return keys.detach(), values.detach()


def _prompts(
    rows: torch.Tensor, shape: torch.Size, mask: torch.Tensor | None
) -> tuple[list[torch.Tensor], tuple[int, ...], list[str]]:
    """Each prompt's rows, the index of its first one, and notes: the rows ``mask`` marks 1 (all rows without it)."""
    batch, length = rows.shape[:2]
    if mask is None:  # pads told only where generate() gave them one position: runs of identical rows
        spans = [pad_span(r) for r in rows]
        offsets, dropped = tuple(a for a, _ in spans), batch * length - sum(b - a for a, b in spans)
        told = f"dropped {dropped} pad row(s): runs of identical rows at a prompt's start or end (--mask to say which)"
        kept = f"kept all {length} rows of each of the {batch} prompts: pads cannot be told apart in a KV cache"
        notes = [told] if dropped else [f"{kept} without the attention mask (pass --mask)"] if batch > 1 else []
        return [r[a:b] for r, (a, b) in zip(rows, spans, strict=True)], offsets, notes + _mask_notes(0, offsets)
    mask = mask.reshape(1, -1) if mask.dim() == 1 else mask
    if mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        layout = " (are they [B, T, H, hd]? transpose them to [B, H, T, hd])" if mask.shape[-1] == shape[1] else ""
        raise LminvertError(
            f"the mask has shape {list(mask.shape)} but the cache holds {batch} prompt(s) of {length} positions"
            f"{layout}: give the batch's attention mask, [B, T] (a cache after generate() also holds the new tokens)"
        )
    if not ((mask == 0) | (mask == 1)).all():
        raise LminvertError("the mask must hold only 0 and 1: give the batch's attention mask")
    prompts, offsets = [], []
    for i, keep in enumerate(mask.bool()):
        kept = keep.nonzero().flatten()
        if len(kept) == 0:
            raise LminvertError(f"the mask keeps no row of prompt {i}: is it the attention mask of this cache?")
        start, stop = int(kept[0]), int(kept[-1]) + 1
        if stop - start != len(kept):
            raise LminvertError(f"the mask of prompt {i} has holes: give an attention mask with left or right padding")
        prompts.append(rows[i, start:stop])
        offsets.append(start)
    return prompts, tuple(offsets), _mask_notes(batch * length - int(mask.bool().sum()), offsets)


def _mask_notes(dropped: int, offsets: list[int]) -> list[str]:
    notes = [f"dropped {dropped} row(s) the attention mask marks as padding"] if dropped else []
    if any(offsets):
        notes.append(
            "left padding: each prompt's rows start at its offset in the padded sequence, where a plain forward "
            "rotated its keys (generate() counts positions from the prompt's first token instead)"
        )
    return notes
