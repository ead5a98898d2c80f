"""Which layer to search a states array at (:func:`resolve_layer`), from the layer fit (:mod:`.layerfit`), and the
one-line errors for states that fit no layer the way they were given: random numbers, all zeros, TransformerLens'
centred rows, one prompt's layers stacked, a window cut from a longer prompt.

Nothing here decides a token: where the states are searched, and only that.
"""

from __future__ import annotations

import torch

from ..captures import pick_layer
from ..errors import LminvertError
from ..models import Layer, LoadedModel
from .layerfit import (
    EMBEDDING,
    FIT,
    LayerFit,
    centred,
    embedding_gap,
    fit_layers,
    settle,
    signature,
)
from .sources import ErrorModel, Exact

SINK = 16.0  # layers where a prompt's first row is at least this many times the later rows' norm (the signature's
# medians: SmolLM2's layers 12-28, 37-163x) are the layers where a window is told by its first row's norm
SHORT = 8.0  # a first row under 1/SHORT of that ratio is no prompt's first position: 140 SmolLM2 prompts (held-out
# texts, openings without BOS, random ids; float32) at layers 12-28 gave at least 0.82 of the layer's ratio; a
# window's first row is about 1x the others' unless it starts at a second attention sink (then it is not told)


def resolve_layer(
    model: LoadedModel, states: list[torch.Tensor], given: Layer | None, source: ErrorModel | None = None
) -> tuple[Layer, LayerFit]:
    """The layer to search at: ``given``, unless the states decisively come from another layer (a one-line error
    naming it) or fit no layer of the model; without ``given``, the best layer when it is decisive or position 0
    chooses it (:func:`settle`). States that look like one prompt's layers stacked, or a window cut from a longer
    prompt (:func:`window`: at a layer whose first row is an attention sink, a first row without its norm), are
    refused as such, there or wherever the fit refuses them."""
    layer, fit = _resolve(model, states, given, source)
    refuse_window(model, states, source, layer)
    return layer, fit


def _resolve(
    model: LoadedModel, states: list[torch.Tensor], given: Layer | None, source: ErrorModel | None
) -> tuple[Layer, LayerFit]:
    refuse_stacked(model, states, source)
    fit = fit_layers(model, states, source)
    probe = model.probe
    searched = given.name if given is not None else fit.best
    if centred(states) and not signature(model).centred[int(probe.layer(searched))]:
        raise LminvertError(
            f"every row of these states has mean 0, which {model.name}'s own states at layer {searched} do not: "
            "TransformerLens' compatibility mode (center_writing_weights) removes each row's mean; capture them "
            "without enable_compatibility_mode() (or pass --no-check to search anyway)"
        )
    anyway = "--no-check" if given is not None else "--layer LAYER --no-check"
    if not fit.fits:
        refuse_window(model, states, source, given)
        raise LminvertError(
            f"these states fit no layer of {model.name}: the closest is {fit.describe()}, where its own states fit "
            f"about 1 and at most {FIT:g}; are they another model's, random, or not starting at the prompt's first "
            f"token? (pass the right --model, or {anyway} to search anyway)"
        )
    # layer 0 searched, or the best fit where it counts (no layer given, or it rules the given one out): an undecided
    # best of 0 says nothing against a given layer (a tiny model's int8 states at its layer 2 fit 0 best by 1.4)
    zero = int(probe.layer(fit.best)) == 0 and (given is None or fit.rules_out(given.name))
    if int(probe.layer(searched)) == 0 or zero:
        if all(not bool(prompt[0].any()) for prompt in states):
            raise LminvertError(
                f"position 0 of every prompt is all zeros: no layer of {model.name} gives that state to a token; "
                f"check the file (or {anyway} to search anyway)"
            )
        if (gap := embedding_gap(model, states, source or Exact())) > EMBEDDING:
            raise LminvertError(
                f"these states fit no layer of {model.name}: as layer 0 (the embeddings), position 0 lies {gap:.2g} of "
                "its norm beyond every token's embedding, where the model's own states lie within rounding of one; "
                f"random numbers at the embeddings' scale? (pass the right --model, or {anyway} to search anyway)"
            )
    if given is None:
        fit = settle(model, states, fit, source)
        if not fit.decisive:
            refuse_window(model, states, source, None)
            raise LminvertError(
                f"cannot tell which layer of {model.name} these states hold: the closest is {fit.describe()}; "
                "pass --layer"
            )
        return probe.layer(fit.best), fit
    if fit.rules_out(given.name):
        refuse_window(model, states, source, given)
        raise LminvertError(
            f"these states are {model.name}'s {fit.describe()}, not layer {given.name}: pass --layer {fit.best} "
            "(or leave --layer out), or --no-check to search layer "
            f"{given.name} anyway"
        )
    return given, fit


def refuse_stacked(model: LoadedModel, states: list[torch.Tensor], source: ErrorModel | None) -> None:
    """A one-line error where ``states`` are one prompt's every layer taken for prompts: as many of one length as
    transformers' ``output_hidden_states`` holds (``n_layers + 1``), the first and the last each decisively not of the
    other's layer (``torch.stack`` of those tensors saved as one ``[L + 1, T, d]`` array)."""
    if len(states) != model.probe.n_layers + 1 or len({len(s) for s in states}) != 1:
        return
    first, last = (fit_layers(model, [states[i]], source) for i in (0, -1))
    if first.rules_out(last.best) and last.rules_out(first.best):  # two layers: one batch's prompts share one
        raise LminvertError(
            f"these {len(states)} prompts of one length look like one prompt's {len(states)} layers stacked "
            f"(torch.stack(output_hidden_states)): the first fits layer {first.best}, the last layer {last.best}; "
            f"{pick_layer(len(states))}"
        )


def window(model: LoadedModel, states: list[torch.Tensor], source: ErrorModel | None, given: Layer | None) -> str:
    """Where ``states`` look like a layer's rows from a later position on (a window cut from a longer prompt): a
    phrase that says so, else ``""``. Their rows scored as later positions must fit ``given`` (unless they rule it
    out), else the layers within ``MARGIN`` of their best; at each of those, a prompt's first row is ``SINK`` times
    the later rows' norm or more, and every prompt's first row lies under ``1/SHORT`` of that ratio."""
    if any(len(s) < 2 for s in states):
        return ""
    later = fit_layers(model, states, source, from_first=False)
    if not later.fits:
        return ""
    close = [given.name] if given is not None and not later.rules_out(given.name) else later.close
    sig, index = signature(model), [int(model.probe.layer(name)) for name in close]
    ratios = [float(sig.first_scale[i] / sig.rest_scale[i]) for i in index]
    seen = max(float(r[0] / r[1:].median()) for r in (s.detach().double().norm(dim=-1) for s in states))
    if min(ratios) < SINK or seen * SHORT > min(ratios):
        return ""
    also = f" (or {', '.join(close[1:])})" if len(close) > 1 else ""
    return (
        f"these states look like {model.name}'s layer {close[0]}{also} from a later position on: their first row's "
        f"norm is {seen:.2g}x the later rows', where a prompt's first position there is {min(ratios):.0f}x or more; "
        "a window cut from a longer prompt, or rows out of order? A window's rows depend on tokens before it that the "
        f"file does not hold: give every row from the prompt's first token (or --layer {close[0]} --no-check to "
        "search it anyway)"
    )


def refuse_window(
    model: LoadedModel, states: list[torch.Tensor], source: ErrorModel | None, given: Layer | None
) -> None:
    """A one-line error where :func:`window` says the states are a window cut from a longer prompt."""
    if text := window(model, states, source, given):
        raise LminvertError(text)
