"""Models: the alias registry, offline sources, loading, the layer probe, and facts about a model's inputs."""

from .layers import DEFAULT_LAYERS, Layer, LayerSpec, parse_layers
from .loading import LoadedModel, load_model
from .probe import LayerProbe, NewKeys, Prefix
from .registry import DEFAULT_MODEL, REGISTRY, ModelSpec

__all__ = ["DEFAULT_LAYERS", "DEFAULT_MODEL", "REGISTRY", "Layer", "LayerProbe", "LayerSpec", "LoadedModel"]
__all__ += ["ModelSpec", "NewKeys", "Prefix", "load_model", "parse_layers"]
