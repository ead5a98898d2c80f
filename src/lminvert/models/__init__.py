"""Models: the alias registry, offline sources, loading, and the layer probe."""

from .loading import LoadedModel, load_model
from .probe import LayerProbe, Prefix
from .registry import DEFAULT_MODEL, REGISTRY, ModelSpec

__all__ = ["DEFAULT_MODEL", "REGISTRY", "LayerProbe", "LoadedModel", "ModelSpec", "Prefix", "load_model"]
