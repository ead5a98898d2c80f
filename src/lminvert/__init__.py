"""lminvert: exact prompt recovery from transformer hidden states, and injectivity (collision) tests."""

from __future__ import annotations

__version__ = "0.1.0"

from .collisions import exhaustive_test, find_collisions, pairwise_min
from .encode import encode
from .errors import LminvertError
from .invert import InversionResult, invert
from .models import DEFAULT_MODEL, LayerProbe, LoadedModel, load_model
from .states import HiddenStates

__all__ = ["DEFAULT_MODEL", "LayerProbe", "LminvertError", "LoadedModel", "__version__", "load_model"]
__all__ += ["exhaustive_test", "find_collisions", "pairwise_min"]
__all__ += ["HiddenStates", "InversionResult", "encode", "invert"]
