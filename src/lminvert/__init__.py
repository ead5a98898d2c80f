"""lminvert: exact prompt recovery from transformer hidden states, and injectivity (collision) tests."""

from __future__ import annotations

from ._version import __version__
from .collisions import exhaustive_test, find_collisions, pairwise_min
from .errors import LminvertError
from .forward import encode
from .invert import InversionResult, Leak, Run, Search, invert
from .kv_captures import KVCapture, read_kv
from .models import DEFAULT_MODEL, Layer, LayerProbe, LoadedModel, load_model
from .report import render
from .states import HiddenStates

__all__ = ["DEFAULT_MODEL", "Layer", "LayerProbe", "LminvertError", "LoadedModel", "__version__", "load_model"]
__all__ += ["exhaustive_test", "find_collisions", "pairwise_min", "render"]
__all__ += ["HiddenStates", "InversionResult", "KVCapture", "Leak", "Run", "Search", "encode", "invert", "read_kv"]
