"""Hidden states of prompts at one layer, and their safetensors file format.

A states file is exactly what leaks in practice (a KV cache, activations in a split-inference pipeline), so
by default it holds only the states and the metadata needed to invert them - not the prompt, not its ids
(``keep_ids=True`` stores the ids, e.g. for evaluation).

Layout: one tensor per prompt, ``states.<i>`` of shape ``[T_i, d]``; optional ``token_ids.<i>`` (int64);
string metadata: format, model, weights_hash, layer, n_layers, hidden_size, dtype, tokens_per_prompt (JSON
list), lminvert_version.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from .captures import read_capture
from .errors import LminvertError
from .paths import atomic_file

FORMAT = "lminvert.states/1"


def half_numbers(tensors: Sequence[torch.Tensor]) -> str | None:
    """The half dtype (``bfloat16``, else ``float16``) of which every value of these float32 or float64 tensors is a
    number, or None: a half model's states (or a KV cache's rows) saved in a wider dtype (as numpy, which has no
    bfloat16, must save them). A float32 computation's values are such numbers with odds of about 2^-16 each."""
    if any(t.dtype not in (torch.float32, torch.float64) for t in tensors):
        return None
    for half in (torch.bfloat16, torch.float16):  # every bfloat16 number in float16's range is a float16 one
        if all(bool((t == t.to(half).to(t.dtype)).all()) for t in tensors):
            return str(half).replace("torch.", "")
    return None


@dataclass(frozen=True)
class HiddenStates:
    """Per-position states of N prompts at one layer of one model."""

    states: tuple[torch.Tensor, ...]  # N tensors [T_i, d]
    model: str | None = None
    weights_hash: str | None = None
    layer: str | None = None  # "0".."L" or "final"
    n_layers: int | None = None
    dtype: str | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None
    lminvert_version: str | None = None
    notes: tuple[str, ...] = ()  # what reading them assumed or changed (pad rows dropped, the entry taken)

    def __post_init__(self) -> None:
        if not self.states:
            raise LminvertError("no states: the file or array holds no prompts")
        for i, state in enumerate(self.states):
            if state.dim() != 2 or state.shape[0] == 0:
                raise LminvertError(f"prompt {i}: states must have shape [T, d] with T >= 1, got {list(state.shape)}")
            if not torch.isfinite(state).all():
                raise LminvertError(
                    f"prompt {i}: states contain NaN or inf; they cannot come from a forward pass - check the file"
                )
        if len({s.shape[1] for s in self.states}) != 1:
            raise LminvertError("all prompts' states must have the same hidden size")

    def half_values(self) -> str | None:
        """:func:`half_numbers` of these states where they record no dtype, else None."""
        return half_numbers(self.states) if self.dtype is None else None

    @property
    def hidden_size(self) -> int:
        return int(self.states[0].shape[1])

    @property
    def lengths(self) -> list[int]:
        return [int(s.shape[0]) for s in self.states]

    def __len__(self) -> int:
        return len(self.states)

    def with_meta(self, **changes) -> HiddenStates:
        return replace(self, **changes)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".safetensors":
            raise LminvertError(f"output must end in .safetensors, got '{path.name}'")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LminvertError(
                f"cannot write {path} ({exc.strerror or type(exc).__name__}): choose another path"
            ) from None
        tensors = {f"states.{i}": s.detach().cpu().contiguous() for i, s in enumerate(self.states)}
        if self.token_ids is not None:
            for i, ids in enumerate(self.token_ids):
                tensors[f"token_ids.{i}"] = torch.tensor(ids, dtype=torch.int64)
        meta = {
            "format": FORMAT,
            "model": self.model or "",
            "weights_hash": self.weights_hash or "",
            "layer": self.layer or "",
            "n_layers": "" if self.n_layers is None else str(self.n_layers),
            "hidden_size": str(self.hidden_size),
            "dtype": self.dtype or str(self.states[0].dtype).replace("torch.", ""),
            "tokens_per_prompt": json.dumps(self.lengths),
            "n_prompts": str(len(self)),
            "lminvert_version": self.lminvert_version or "",
        }
        try:
            with atomic_file(path) as tmp:
                save_file(tensors, str(tmp), metadata=meta)
        except OSError as exc:
            raise LminvertError(
                f"cannot write {path} ({exc.strerror or type(exc).__name__}): choose another path"
            ) from None
        return path

    @classmethod
    def load(cls, path: str | Path, key: str | None = None, mask: str | Path | None = None) -> HiddenStates:
        """Read a states file: a ``.safetensors`` written by lminvert, or a capture saved elsewhere (see
        :mod:`lminvert.captures`: ``.npy``, ``.npz``, ``.pt``/``.pth`` holding a tensor, a list or a dict of tensors,
        or a ``.safetensors`` with any key names; ``key`` picks one entry of several). Pad rows are dropped: those a
        ``mask`` file (``[N, T]`` or ``[T]`` of 0/1) or a mask saved beside the states marks, and runs of identical
        rows at a prompt's start or end; ``notes`` says what was dropped or assumed."""
        path = Path(path)
        if not path.exists():
            raise LminvertError(f"states file not found: {path}")
        if not path.is_file():
            raise LminvertError(f"not a file: {path}")
        suffix = path.suffix.lower()
        if suffix == ".safetensors" and key is None:
            own = cls._load_own(path)
            if own is not None:
                if mask is not None:
                    raise LminvertError("--mask is for captures saved elsewhere: a states file from encode has no pads")
                return own
        if suffix not in (".safetensors", ".npy", ".npz", ".pt", ".pth"):
            raise LminvertError(
                f"unsupported states file '{path.name}': use .safetensors (lminvert encode or any), .npy, .npz, .pt or "
                ".pth"
            )
        states, notes = read_capture(path, key=key, mask=mask)
        return cls.from_array(states, notes=notes)

    @classmethod
    def _load_own(cls, path: Path) -> HiddenStates | None:
        """A states file written by lminvert, or None where the safetensors file is not one."""
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            if meta.get("format") != FORMAT:
                return None
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise LminvertError(f"cannot read {path.name} as safetensors ({exc}); is it a states file?") from exc
        n = int(meta.get("n_prompts", "0"))
        try:
            states = tuple(tensors[f"states.{i}"] for i in range(n))
        except KeyError as exc:
            raise LminvertError(f"{path.name} is truncated or corrupt: missing {exc}") from None
        ids = None
        if n and "token_ids.0" in tensors:
            ids = tuple(tuple(int(x) for x in tensors[f"token_ids.{i}"].tolist()) for i in range(n))
        return cls(
            states=states,
            model=meta.get("model") or None,
            weights_hash=meta.get("weights_hash") or None,
            layer=meta.get("layer") or None,
            n_layers=int(meta["n_layers"]) if meta.get("n_layers") else None,
            dtype=meta.get("dtype") or None,
            token_ids=ids,
            lminvert_version=meta.get("lminvert_version") or None,
        )

    @classmethod
    def from_array(cls, array: torch.Tensor | np.ndarray | Sequence[torch.Tensor], **meta) -> HiddenStates:
        if isinstance(array, np.ndarray):
            array = torch.from_numpy(array)
        if isinstance(array, torch.Tensor):
            if not array.is_floating_point():
                raise LminvertError(f"states must be floating point, got {array.dtype}")
            if array.dim() == 1:  # one position's state (one vector: a last-position leak)
                array = array[None]
            if array.dim() == 2:
                array = array[None]
            if array.dim() != 3:
                raise LminvertError(f"states must have shape [d], [T, d] or [N, T, d], got {list(array.shape)}")
            if array.shape[0] == 0 or array.shape[1] == 0:
                raise LminvertError(f"states array is empty (shape {list(array.shape)})")
            if array.dtype in (torch.bfloat16, torch.float16):  # a half-precision array says how it was computed
                meta.setdefault("dtype", str(array.dtype).replace("torch.", ""))
            items = tuple(array[i] for i in range(array.shape[0]))
        else:
            items = tuple(array)
            kinds = {t.dtype for t in items if isinstance(t, torch.Tensor)}
            if len(kinds) == 1 and kinds <= {torch.bfloat16, torch.float16}:  # as one half-precision array says
                meta.setdefault("dtype", str(kinds.pop()).replace("torch.", ""))
        return cls(states=items, **meta)
