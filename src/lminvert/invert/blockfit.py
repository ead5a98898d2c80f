"""Which block a KV cache comes from, found from its rows alone, as :mod:`.layerfit` finds a states array's layer.

A KV signature per model and dtype (built once from the layer signature's sample prompts: their states at every layer
by one forward each, each block's keys after the rotary embedding and values computed from them through the KV view,
then the same statistics; cached) scores the rows against every block; the best block is taken where it is decisive
(``layerfit.MARGIN``) and fits (``layerfit.FIT``), else a one-line error asks for ``--layer``. It chooses where the rows
search runs, never what it accepts (:mod:`.acceptor`).
"""

from __future__ import annotations

import torch

from ..errors import LminvertError
from ..models import Layer, LoadedModel
from ..models.kv import kv_block
from .layerfit import LayerFit, Signature, cached_signature, sample_states, score, statistics
from .sources import ErrorModel

KIND = "kv-signature2"  # the cache's name; a new name whenever how it is built changes


def kv_signature(model: LoadedModel) -> Signature:
    """The model's KV signature in its dtype, entries for blocks ``1..L`` (built on first use, cached)."""
    return cached_signature(model, KIND, lambda: statistics(_sample_rows(model)), "KV signature")


def _sample_rows(model: LoadedModel) -> torch.Tensor:
    """``[L, prompts, T, D]``: each block's cache rows of the sample prompts, from their states."""
    states = {int(layer): value for layer, value in sample_states(model, list(range(model.probe.n_layers))).items()}
    blocks = [kv_block(model, b) for b in range(1, model.probe.n_layers + 1)]
    positions = range(states[0].shape[1])
    return torch.stack(
        [torch.stack([b.rows(states[b.block - 1][:, p], p) for p in positions], 1) for b in blocks]
    ).double()


def fit_blocks(model: LoadedModel, rows: list[torch.Tensor], source: ErrorModel | None = None) -> LayerFit:
    """Every block's KV signature scored against ``rows`` (each prompt's ``[T, D]``, from position 0)."""
    names = [str(b) for b in range(1, model.probe.n_layers + 1)]
    return score(kv_signature(model), names, rows, source, model.name, what="block")


def resolve_block(
    model: LoadedModel, rows: list[torch.Tensor], source: ErrorModel | None = None
) -> tuple[Layer, LayerFit]:
    """The block whose KV cache ``rows`` (each prompt's ``[T, D]``, from position 0) are: the best-scoring block where
    it fits and is decisive; a one-line error else."""
    fit = fit_blocks(model, rows, source)
    if not fit.fits:
        raise LminvertError(
            f"these rows fit no block's KV cache of {model.name}: the closest is {fit.describe()}; are they another "
            "model's, or not a KV cache? (pass the right --model, or --layer with the block)"
        )
    if not fit.decisive:
        raise LminvertError(
            f"cannot tell which block of {model.name} this KV cache holds: the closest is {fit.describe()}; pass "
            "--layer with the block (transformers' cache.layers[B - 1] is block B)"
        )
    return model.probe.layer(int(fit.best)), fit


def refuse_other_block(model: LoadedModel, rows: list[torch.Tensor], block: int) -> None:
    """A one-line error where the rows of a KV cache that does not say its block, given as block ``block``, fit
    another block and rule ``block`` out (as :func:`lminvert.invert.layerchoice.resolve_layer` does for states)."""
    fit = fit_blocks(model, rows)
    if str(block) in fit.scores and fit.rules_out(str(block)):
        raise LminvertError(
            f"these rows are {model.name}'s {fit.describe()} KV cache, not block {block}: pass --layer {fit.best} (or "
            f"leave --layer out), or --no-check to search block {block} anyway"
        )
