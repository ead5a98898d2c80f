"""Whether a states file can have come from a model: weights, precision, hidden size and layer must agree."""

from __future__ import annotations

from ..errors import LminvertError
from ..states import HiddenStates
from .layers import Layer, LayerSpec
from .loading import LoadedModel

# half file dtypes a float32 computation's rows may be cast to for storage, and the ``quant:`` kind that models the cast
CASTS = {"bfloat16": "bf16", "float16": "fp16"}


def check_dtype(dtype: str | None, model: LoadedModel, what: str = "states", stored: str | None = None) -> None:
    """A one-line error where ``what`` (states, a KV cache's rows) were computed in ``dtype`` and ``model`` runs in
    another (None: not recorded, nothing to check); ``stored``: the half dtype the error model says a float32
    computation's rows were cast to for storage (``quant:bf16``, ``quant:fp16``), which a float32 model reads."""
    if dtype is None or dtype == model.dtype or (dtype == stored and model.dtype == "float32"):
        return
    cast = CASTS.get(dtype)
    hint = f"; if a float32 model computed them and they were saved in {dtype}: --dtype float32 --source quant:{cast}"
    raise LminvertError(
        f"these {what} were computed in {dtype} but '{model.name}' runs in {model.dtype}: load the model with --dtype "
        f"{dtype} (dtype='{dtype}'), or leave --dtype out to take the file's{hint if cast else ''}"
    )


def check_compatible(
    states: HiddenStates, model: LoadedModel, layer: LayerSpec | None, stored: str | None = None
) -> Layer | None:
    """Check that ``states`` can come from ``model``; return the resolved layer (from the file if not given; None
    where neither says: the caller finds it from the states). ``stored``: as :func:`check_dtype`'s."""
    probe = model.probe
    if states.weights_hash and states.weights_hash != model.weights_hash:
        raise LminvertError(
            f"these states were made by a model with weights hash {states.weights_hash} ('{states.model}'), "
            f"not by '{model.name}' ({model.weights_hash}); pass the model that produced them with --model"
        )
    check_dtype(states.dtype, model, stored=stored)
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
