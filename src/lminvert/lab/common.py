"""What the three labs share: small random models of a named shape, a tokenizer, prompt sets and the exact
minimum pairwise distance of last-token states per layer (via :func:`lminvert.pairwise_min`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..collisions import pairwise_min
from ..corpora import sample_prompts
from ..experiments.base import THRESHOLD, Context
from ..forward import last_token_states
from ..models import LoadedModel, load_model


def shape_config(arch: str, vocab: int, d: int, layers: int, heads: int = 4) -> dict[str, Any]:
    """transformers config arguments for a small GPT-2 or Llama of width ``d`` and depth ``layers``."""
    if arch == "gpt2":
        return {
            "vocab_size": vocab,
            "n_embd": d,
            "n_layer": layers,
            "n_head": heads,
            "n_positions": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    if arch == "llama":
        return {
            "vocab_size": vocab,
            "hidden_size": d,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "intermediate_size": 2 * d,
            "max_position_embeddings": 256,
        }
    raise ValueError(f"unknown architecture {arch!r} (gpt2 or llama)")


def random_model(arch: str, seed: int, vocab: int, d: int, layers: int, **extra: Any) -> PreTrainedModel:
    """A randomly initialised float32 model, its initialisation seeded without touching the caller's RNG."""
    config = AutoConfig.for_model(arch, **{**shape_config(arch, vocab, d, layers), **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tokenizer(ctx: Context) -> object:
    """The SmolLM2 tokenizer (what every built-in model uses), loaded once per run."""
    return ctx.once("tokenizer", lambda: load_model("tiny-gpt2").tokenizer)


def corpus_ids(ctx: Context, n: int, max_tokens: int, seed: int, corpus: str = "mixed") -> list[list[int]]:
    """``n`` distinct token windows of the built-in corpus (the same for every unit of a run)."""

    def draw() -> list[list[int]]:
        prompts, _ = sample_prompts(tokenizer(ctx), corpus, n, max_tokens=max_tokens, seed=seed, min_tokens=max_tokens)
        return [list(p.ids) for p in prompts]

    return ctx.once(("corpus", n, max_tokens, seed, corpus), draw)


def layer_minima(
    model: LoadedModel, ids: Sequence[Sequence[int]], layers: Sequence[int], k: int = 3
) -> dict[int, Mapping[str, Any]]:
    """Per layer: exact minimum distance between last-token states, pairs under the threshold, closest pairs."""
    states = last_token_states(model, ids, list(layers))
    out: dict[int, Mapping[str, Any]] = {}
    for layer, x in states.items():
        result = pairwise_min(np.ascontiguousarray(x), k=k, threshold=THRESHOLD)
        out[int(layer)] = {
            "min_distance": float(result.min_distance),
            "below_threshold": int(result.n_below_threshold),
            "closest": [[p.i, p.j, p.distance] for p in result.closest[:k]],
            "mean_norm": float(np.linalg.norm(x, axis=1).mean()),
        }
    return out
