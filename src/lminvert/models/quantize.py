"""Weight quantisation with bitsandbytes: a quantised copy of a :class:`LoadedModel`.

Schemes, as bitsandbytes defines them (its CPU backend runs all of them):

* ``int8`` - LLM.int8 as transformers' ``load_in_8bit`` sets it up (``bnb.nn.Linear8bitLt``,
  ``has_fp16_weights=False``, outlier threshold 6.0): each weight row is scaled by its absolute maximum to int8.
  At run time the layer's *input* is cast to float16 and quantised to int8 row by row as well, except the
  feature columns where any row of the batch exceeds 6.0, which stay in float16. Which columns those are depends
  on every row of the matmul: other positions of the prompt (later ones too) and other prompts of the batch.
  So a state is no longer a function of its prefix alone.
* ``int8-t0`` - the same with threshold 0: weights and inputs all int8, row by row (no outlier columns).
  Each row's result depends on that row only and the integer matmul is exact, so batched and full forwards
  usually agree bit for bit; but where a float rounding difference upstream (attention) puts an input on the
  other side of an int8 rounding boundary, the state jumps by a whole quantisation step.
* ``nf4`` / ``fp4`` - ``bnb.nn.Linear4bit``: 4-bit NormalFloat / 4-bit float codes in blocks of 64 weights, one
  absmax scale per block; at run time the weight is dequantised and multiplied in float32 (``compute_dtype``),
  the input untouched (weight-only quantisation).

As transformers' ``BitsAndBytesConfig`` does, every ``nn.Linear`` (and GPT-2's ``Conv1D``) is replaced except the
output head; embeddings and norms stay float32, so the layer probe, the input vectors (``vocab_matrix``) and the
acceptance tolerance are those of a float32 model.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import logging

import torch
from torch import nn

from ..errors import LminvertError
from .loading import LoadedModel

SCHEMES = ("int8", "int8-t0", "nf4", "fp4")
INT8_THRESHOLD = {"int8": 6.0, "int8-t0": 0.0}  # 6.0: transformers' BitsAndBytesConfig.llm_int8_threshold default
INSTALL = "pip install 'lminvert[quant]'"


class _QuietCast(logging.Filter):
    """bitsandbytes logs 'inputs will be cast ... to float16' on every int8 matmul; that is documented above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will be cast" not in record.getMessage()


def _bitsandbytes():
    try:
        bnb = importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise LminvertError(f"weight quantisation needs bitsandbytes: {INSTALL}") from exc
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _QuietCast) for f in log.filters):
        log.addFilter(_QuietCast())
    return bnb


def library_version() -> str:
    """``"bitsandbytes X.Y.Z"`` (what results record), or a one-line error if it is not installed."""
    return f"bitsandbytes {_bitsandbytes().__version__}"


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _quantised(module: nn.Module, scheme: str, bnb) -> nn.Module:
    weight = module.weight.detach().float()
    if not isinstance(module, nn.Linear):  # Conv1D keeps its weight as [in, out]
        weight = weight.t()
    weight = weight.contiguous().clone()
    n_out, n_in = weight.shape
    bias = module.bias is not None
    if scheme in INT8_THRESHOLD:
        layer = bnb.nn.Linear8bitLt(
            n_in, n_out, bias=bias, has_fp16_weights=False, threshold=INT8_THRESHOLD[scheme], device="meta"
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(n_in, n_out, bias=bias, compute_dtype=torch.float32, quant_type=scheme, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=scheme)
    if bias:
        layer.bias = nn.Parameter(module.bias.detach().float().clone(), requires_grad=False)
    return layer.to("cpu")  # bitsandbytes quantises a weight when it is moved to a device


def quantize(model: LoadedModel, scheme: str) -> LoadedModel:
    """A new :class:`LoadedModel` whose linear layers are quantised with ``scheme`` (see :data:`SCHEMES`).

    ``model`` (float32, on the CPU) is left as it was: the quantised model is a copy, named
    ``"<name>+<scheme>"``. Its weights hash covers the base weights, the scheme, the bitsandbytes version and the
    quantised parameters (the block scales are not parameters, so those alone would not identify it).
    """
    if scheme not in SCHEMES:
        raise LminvertError(f"unknown quantisation scheme '{scheme}': use one of {', '.join(SCHEMES)}")
    if model.probe.dtype != torch.float32 or model.probe.device.type != "cpu":
        raise LminvertError(
            f"quantize needs a float32 model on the CPU; '{model.name}' is {model.dtype} on {model.probe.device}: "
            "load it with dtype='float32', device='cpu' (--dtype float32 --device cpu)"
        )
    bnb = _bitsandbytes()
    net = copy.deepcopy(model.model)
    head = net.get_output_embeddings()
    replaced = 0
    for parent in list(net.modules()):
        for child_name, child in list(parent.named_children()):
            if child is not head and _is_linear(child):
                setattr(parent, child_name, _quantised(child, scheme, bnb))
                replaced += 1
    if replaced == 0:
        raise LminvertError(f"'{model.name}' has no linear layers to quantise")
    loaded = LoadedModel.wrap(f"{model.name}+{scheme}", net, model.tokenizer)
    digest = hashlib.sha256()
    for part in (model.weights_hash, scheme, bnb.__version__, loaded.weights_hash):
        digest.update(part.encode() + b"\0")
    return dataclasses.replace(loaded, weights_hash=digest.hexdigest()[:16])


def quantized_layers(model: LoadedModel) -> int:
    """How many of ``model``'s linear layers are bitsandbytes-quantised (0 for a float model)."""
    return sum(1 for m in model.model.modules() if type(m).__module__.startswith("bitsandbytes"))
