"""First-position tables: the layer-l state of every vocabulary token at position 0, cached on disk.

Position 0 has no prefix, so its state depends on the token alone: recovering it is a nearest-neighbour
look-up in this table. (At middle layers the first position is an attention sink with a norm ~100x the
others, which makes gradient signals there useless.) Built once per model, layer and dtype with batched
one-position forwards, then read from ``<cache>/tables/``.
"""

from __future__ import annotations

import logging
import time

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..models import LoadedModel
from ..paths import cache_dir

log = logging.getLogger(__name__)

_MEMORY: dict[tuple[str, int, str], torch.Tensor] = {}


def first_position_table(model: LoadedModel, layer: int, batch: int = 1024, progress: bool = True) -> torch.Tensor:
    """``[V, d]`` float32 states of each token alone at ``layer`` (built and cached on first use)."""
    probe = model.probe
    key = (model.weights_hash, layer, model.dtype)
    if key in _MEMORY:
        return _MEMORY[key]
    path = cache_dir() / "tables" / f"{model.weights_hash}-{model.dtype}-layer{probe.layer_name(layer)}.safetensors"
    if path.is_file():
        table = load_file(str(path))["states"]
    else:
        start = time.perf_counter()
        empty = probe.prefix([], layer)
        ids = torch.arange(probe.vocab_size)
        parts = []
        with torch.no_grad():
            for chunk in tqdm(
                ids.split(batch), desc=f"first-position table (layer {layer})", disable=not progress, leave=False
            ):
                parts.append(probe.continuation(empty, token_ids=chunk).float())
        table = torch.cat(parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"states": table.contiguous()}, str(tmp))
        tmp.rename(path)
        log.info("built first-position table for layer %s in %.1f s", layer, time.perf_counter() - start)
    _MEMORY[key] = table
    return table


def second_position_map(
    model: LoadedModel, layer: int, contexts: int = 12, samples: int = 256, seed: int = 0, outlier: float = 4.0
) -> torch.Tensor:
    """A secant linear map ``J`` [d, d] from input embeddings to position-1 states, for random first tokens.

    Position 1 sees only the first token and itself; a ridge fit over ``contexts`` random first tokens x
    ``samples`` random second tokens (centred per context, attention-sink outliers dropped) is a good prior
    for :class:`~lminvert.invert.policies.LinearPolicy` there. Built once per model and layer, cached.
    """
    probe = model.probe
    key = (model.weights_hash + ":J1", layer, model.dtype)
    if key in _MEMORY:
        return _MEMORY[key]
    name = f"{model.weights_hash}-{model.dtype}-layer{probe.layer_name(layer)}-position1-map.safetensors"
    path = cache_dir() / "tables" / name
    if path.is_file():
        jac = load_file(str(path))["J"]
    else:
        gen = torch.Generator().manual_seed(seed)
        vocab = probe.vocab_matrix().double()
        xs, hs = [], []
        with torch.no_grad():
            for first in torch.randint(0, probe.vocab_size, (contexts,), generator=gen).tolist():
                ids = torch.randint(0, probe.vocab_size, (samples,), generator=gen)
                states = probe.continuation(probe.prefix([first], layer), token_ids=ids).double()
                keep = states.norm(dim=1) <= outlier * states.norm(dim=1).median()
                x, h = vocab[ids][keep], states[keep]
                xs.append(x - x.mean(0))
                hs.append(h - h.mean(0))
        x, h = torch.cat(xs), torch.cat(hs)
        eye = torch.eye(x.shape[1], dtype=torch.float64)
        jac = torch.linalg.solve(x.T @ x + 1e-3 * float(x.square().sum()) * eye, x.T @ h)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"J": jac.contiguous()}, str(tmp))
        tmp.rename(path)
    _MEMORY[key] = jac
    return jac
