"""Loading a model by alias, hub id, directory or .gguf path, into a :class:`LoadedModel`."""

from __future__ import annotations

import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..errors import LminvertError
from . import sources
from .hf_internals import attn_implementation
from .probe import LayerProbe
from .registry import DEFAULT_MODEL, ModelSpec, resolve

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device ``device`` names: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``,
    ``cuda:N`` or ``mps``. Checked now, with a one-line error naming ``--device`` when it is not usable here."""
    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(text)
    except (RuntimeError, ValueError):
        raise LminvertError(f"unknown device '{device}': use {DEVICES} (--device)") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise LminvertError(
                f"device '{device}' asked for, but this torch ({torch.__version__}) sees no CUDA GPU: "
                "use --device cpu, or install a CUDA build of torch (see the README)"
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise LminvertError(f"device '{device}' does not exist: this machine has cuda:0..cuda:{count - 1}")
        return resolved
    if resolved.type == "mps":
        if not torch.backends.mps.is_available():
            raise LminvertError(f"device '{device}' asked for, but MPS is not available here: use --device cpu")
        return resolved
    raise LminvertError(f"unsupported device '{device}': use {DEVICES} (--device)")


def token_id_list(value: Any) -> list[int] | None:
    """``value`` as a list of token ids (a list or tuple of integers, or a tensor or array of them), or None where it
    is not one (a text, a list of lists, None)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(t, Integral) for t in value):
        return None
    return [int(t) for t in value]


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for probing: the unmodified transformers model, its tokenizer and identity.

    ``weights_hash`` identifies the weights (states files and cached tables are keyed by it). It is computed
    when the object is made: after editing the weights in place, make a new object with :meth:`wrap` so the
    hash, the probe and everything derived from the old weights are recomputed.
    """

    name: str
    model: PreTrainedModel
    tokenizer: object | None
    weights_hash: str
    spec: ModelSpec | None = None
    memo: dict = field(default_factory=dict, repr=False)  # derived data (tables) of these weights, this object only
    device_asked: str = field(default="", compare=False)  # load_model's device argument ("auto": resolved here)

    @classmethod
    def wrap(cls, name: str, model: PreTrainedModel, tokenizer: object | None = None) -> LoadedModel:
        """A :class:`LoadedModel` around any transformers causal LM (its weights hash computed now)."""
        model.eval().requires_grad_(False)
        return cls(name=name, model=model, tokenizer=tokenizer, weights_hash=sources.weights_hash(model))

    @cached_property
    def probe(self) -> LayerProbe:
        return LayerProbe(self.model)

    @property
    def dtype(self) -> str:
        return str(self.probe.dtype).replace("torch.", "")

    @property
    def device(self) -> torch.device:
        """Where the weights live; every tensor lminvert computes with this model is made there."""
        return self.probe.device

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text`` as the model's tokenizer makes them (its own special tokens included)."""
        if not isinstance(text, str):
            raise LminvertError(f"tokenize takes a text, not {type(text).__name__} {text!r:.60}")
        if not text or not text.strip():
            raise LminvertError("empty text: give a prompt with at least one non-blank character")
        if self.tokenizer is None:
            raise LminvertError(
                f"model '{self.name}' has no tokenizer, so text cannot be encoded: give token ids instead (Python: "
                "lminvert.encode(model, [[17, 4021, 5]], layer)), or a model directory with its tokenizer files"
            )
        ids = list(self.tokenizer(text)["input_ids"])
        if max_tokens is not None:
            ids = ids[:max_tokens]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (a list, tuple, tensor or array of ids); no tokenizer: the ids as numbers."""
        ids = token_id_list(token_ids)
        if ids is None:
            raise LminvertError(f"decode takes token ids, not {token_ids!r:.60}")
        token_ids = ids
        if self.tokenizer is None:
            return " ".join(str(t) for t in token_ids)
        return self.tokenizer.decode(token_ids)

    def describe(self) -> dict:
        probe = self.probe
        return {
            "model": self.name,
            "architecture": self.model.config.model_type,
            "n_layers": probe.n_layers,
            "hidden_size": probe.hidden_size,
            "vocab_size": probe.vocab_size,
            "dtype": self.dtype,
            "device": str(self.device),
            "weights_hash": self.weights_hash,
            "attn_implementation": attn_implementation(self.model.config),
            "numeric_path": probe.numeric_path,
            "threads": torch.get_num_threads(),
        }


def require_loaded(model: object, caller: str) -> LoadedModel:
    """``model`` if it is a :class:`LoadedModel`; else a one-line error (compute never resolves names)."""
    if not isinstance(model, LoadedModel):
        raise LminvertError(f"{caller} needs a loaded model: model = lminvert.load_model(name), then pass model")
    return model


def _random_model(spec: ModelSpec, seed: int) -> tuple[PreTrainedModel, object]:
    assert spec.model_type is not None
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    with torch.random.fork_rng(devices=[]):  # seed the initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(sources.tokenizer_dir())
    return model, tokenizer


def _hub_access(repo: str, timeout: float = 3.0) -> dict[str, bool]:
    """How to load hub id ``repo``: as usual where the hub answers within ``timeout`` seconds; from the local Hugging
    Face cache alone where it does not (offline, or no network: transformers would otherwise retry for ~30 s before
    failing); a one-line error where it is not cached either."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            return {}
        except OSError:
            pass
    if isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return {"local_files_only": True}
    raise LminvertError(
        f"model '{repo}' is not in the local Hugging Face cache and the hub cannot be reached to download it: run "
        "once where it can (the files are then cached), or give a local model directory or a .gguf file"
    )


def _external(name: str) -> tuple[PreTrainedModel, object]:
    path = Path(os.path.expanduser(name))
    try:
        if name.endswith(".gguf"):
            if not path.is_file():
                raise LminvertError(f"GGUF file not found: {name}")
            kwargs = {"gguf_file": path.name}
            where: str | Path = path.parent
        else:
            kwargs = {}
            # a path, not a hub id (org/name): a leading ./ / ~, or more than one separator
            local = name.startswith((".", "/", "~")) or (os.sep in name and name.count("/") != 1)
            if local and not path.exists():
                raise LminvertError(f"model directory not found: {name}")
            where = path if path.exists() else name
            if not path.exists():
                kwargs = _hub_access(name)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        except Exception:  # a model directory without tokenizer files still works on ids
            tokenizer = None
    except LminvertError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LminvertError(
            f"could not load model '{name}' ({first}); give a registered alias (lminvert models), "
            "a local transformers model directory, a .gguf file, or a hub id on a machine with network access"
        ) from exc
    if model.config.is_encoder_decoder:
        raise LminvertError(f"'{name}' is an encoder-decoder model; lminvert needs a decoder-only causal LM")
    return model, tokenizer


def cast(model: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """``model`` (float32) in ``dtype`` on ``device``, its buffers in the dtypes a model loaded in ``dtype`` has
    (``from_pretrained(..., dtype=...)``, the usual way to run a half model): there a rotary embedding's frequencies
    stay float32, where a cast of the whole model rounds them to the half dtype and so turns every position's keys but
    the first (SmolLM2 in bfloat16, a 37-token prompt: block 15's keys up to 0.42 off, no row after position 0
    reproduced). The dtypes are read from the model built on the meta device (no weights, no memory)."""
    kept = dict(model.named_buffers())
    model = model.to(device=device, dtype=dtype)
    if dtype == torch.float32 or not kept:
        return model
    try:
        with torch.device("meta"):
            built = dict(AutoModelForCausalLM.from_config(model.config, dtype=dtype).named_buffers())
    except Exception as exc:  # an architecture transformers cannot build from its config alone: the cast as it is
        log.warning("buffers left as cast to %s (%s: %s)", dtype, type(exc).__name__, exc)
        return model
    for name, buffer in model.named_buffers():
        wanted = built.get(name)
        if wanted is not None and wanted.dtype != buffer.dtype:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, kept[name].to(device=device, dtype=wanted.dtype))
    return model


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> LoadedModel:
    """Load ``name`` (alias, hub id, directory or .gguf path): a new, independent object on every call.

    ``dtype``: ``float32``, ``bfloat16`` or ``float16`` (the weights are cast once, after loading; the buffers keep
    the dtypes transformers gives a model loaded in that dtype: :func:`cast`).
    ``device``: ``cpu`` (the default, so that results are reproducible anywhere), ``auto`` (CUDA when
    available, else the CPU), ``cuda``, ``cuda:N`` or ``mps``; everything computed with the model (forwards,
    inversion tables, candidate rankings) is made on that device. Converted models load from the cache in about
    a second; hold on to the result rather than reloading.
    """
    if isinstance(name, Path):
        name = str(name)
    if not isinstance(name, str) or not name.strip():
        raise LminvertError(
            f"load_model takes a model's name ('{DEFAULT_MODEL}', a hub id, a directory or a .gguf path), "
            f"not {name!r:.60}"
        )
    if dtype not in DTYPES:
        raise LminvertError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    target = resolve_device(device)
    label = name if seed is None else f"{name}@{seed}"
    spec = resolve(name)
    if spec is not None and spec.kind == "gguf-package":
        directory = sources.convert(spec)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        digest = sources.converted_meta(spec.alias)["weights_hash"]
    elif spec is not None:
        model, tokenizer = _random_model(spec, spec.seed if seed is None else seed)
        digest = sources.weights_hash(model)
    else:
        model, tokenizer = _external(name)
        digest = sources.weights_hash(model)
    model = cast(model, DTYPES[dtype], target).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(
        name=label, model=model, tokenizer=tokenizer, weights_hash=digest, spec=spec, device_asked=str(device).lower()
    )
    log.info(
        "loaded %s (%s on %s, %d layers, d=%d)", name, dtype, target, loaded.probe.n_layers, loaded.probe.hidden_size
    )
    return loaded
