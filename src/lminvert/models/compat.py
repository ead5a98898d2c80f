"""Whether a states file can have come from a model: weights, precision, hidden size and layer must agree."""

from __future__ import annotations

from ..errors import LminvertError
from ..states import HiddenStates
from .layers import Layer, LayerSpec
from .loading import LoadedModel


def check_dtype(dtype: str | None, model: LoadedModel, what: str = "states") -> None:
    """A one-line error where ``what`` (states, a KV cache's rows) were computed in ``dtype`` and ``model`` runs in
    another (None: not recorded, nothing to check)."""
    if dtype is not None and dtype != model.dtype:
        raise LminvertError(
            f"these {what} were computed in {dtype} but '{model.name}' runs in {model.dtype}: "
            f"load the model with --dtype {dtype} (dtype='{dtype}'), or leave --dtype out to take the file's"
        )


def check_compatible(states: HiddenStates, model: LoadedModel, layer: LayerSpec | None) -> Layer | None:
    """Check that ``states`` can come from ``model``; return the resolved layer (from the file if not given; None
    where neither says: the caller finds it from the states)."""
    probe = model.probe
    if states.weights_hash and states.weights_hash != model.weights_hash:
        raise LminvertError(
            f"these states were made by a model with weights hash {states.weights_hash} ('{states.model}'), "
            f"not by '{model.name}' ({model.weights_hash}); pass the model that produced them with --model"
        )
    check_dtype(states.dtype, model)
    if states.hidden_size != probe.hidden_size:
        raise LminvertError(
            f"states have hidden size {states.hidden_size} but '{model.name}' has {probe.hidden_size}; "
            "pass the model that produced them with --model"
        )
    if layer is None:
        layer = states.layer
    if layer is None:
        return None
    resolved = probe.layer(layer)
    if states.layer is not None and probe.layer(states.layer) != resolved:
        raise LminvertError(f"the states file holds layer {states.layer}, not {layer}; drop --layer or fix it")
    return resolved
