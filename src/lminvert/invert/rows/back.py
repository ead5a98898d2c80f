"""A view's rows read back as the states they were computed from, so that the states' reading (network or linear map,
:func:`lminvert.invert.reader.reading_for`) ranks a view's candidates too (a proposal only: every candidate is still
verified, so a poor reading costs time, never an answer).

A KV cache's rows are a linear function of each state's RMS-normalised direction (keys, then values; the keys turned
by their position's rotary embedding), and narrower than the state (SmolLM2: 384 numbers of 576): the directions they
do not see are guessed by a ridge regression from the rows (:meth:`lminvert.invert.views.View.settled`: the rotation
undone, made unit) to the unit states, fitted once per model, dtype and layer on the reading's own training prompts
(:func:`lminvert.invert.reading.training_prompts`) and cached beside the tables. On SmolLM2, 8 held-out prompts of 20
tokens: the layer's reading of the rows read back put the true token first at 58 of 152 positions at block 15 and 59 at
block 30, among its first 8 at 81 and 102 (the states themselves: 82 and 76 first, 91 and 111 among 8).
"""

from __future__ import annotations

import torch

from ...errors import LminvertError
from ...forward import prompt_states
from ...models import LoadedModel
from ..reading import reading_maps, training_forward, training_prompts
from ..secant import fit_secant_map
from ..tables import cached, kept
from ..views import View, make_view

KIND = "back-map1"  # the cache's name (with the view's); a new one whenever the fit changes
RIDGE = 1e-4  # relative to the features' mean squared norm


def _unit(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


def _features(rows: torch.Tensor) -> torch.Tensor:
    """``[n, k + 1]``: each settled row made unit, and a 1."""
    unit = _unit(rows)
    return torch.cat([unit, torch.ones_like(unit[:, :1])], dim=1)


def back_map(view: View, shared: dict[str, list] | None = None) -> torch.Tensor:
    """``W`` ``[k + 1, d]`` (float64, on the CPU): unit states predicted from :func:`_features` of settled rows.
    ``shared``: the reading's training prompts' states at the view's states layer, where a caller computed them
    (:func:`lminvert.invert.reading.reading_maps`' ``shared``; else one forward of those prompts, which also builds the
    layer's reading map where it is not kept yet)."""
    layer = view.states_layer

    def build() -> torch.Tensor:
        made = shared if shared else {}
        if not made:
            reading_maps(view.model, [layer], made)  # the reading's training forward, where its map is not kept yet
        if not made:
            made["states"] = prompt_states(view.model, training_prompts(view.model), [layer], progress=False)
        states = torch.cat([s[layer][1:] for s in made["states"]])  # position 0 is the first-position table's
        x = _features(view.rows_of(states, 0))
        return fit_secant_map(x, _unit(states), ridge=RIDGE / len(x))  # its penalty is relative to ||x||^2

    return cached(view.model, layer, f"{KIND}-{view.name}", build).double().cpu()


def back_maps(model: LoadedModel, shared: dict[str, list]) -> int:
    """:func:`back_map` of every KV block after the first (block 1's rows are ranked by the table) from the reading's
    training states at every layer (``shared``, as :func:`lminvert.invert.reading.reading_maps` fills it; where it is
    empty and a map is missing, that forward is run now and ``shared`` filled), those not kept yet; how many were made
    (0 for a model whose attention is not Llama-style)."""
    made = 0
    for block in range(2, model.probe.n_layers + 1):
        try:
            view = make_view("kv", model, model.probe.layer(block))
        except LminvertError:
            return made
        if kept(model, view.states_layer, f"{KIND}-{view.name}") is None:
            if not shared:  # the reading maps were kept already (a preparation stopped after them)
                shared.update(training_forward(model, model.probe.layers("all")))
            back_map(view, shared)
            made += 1
    return made


def read_back(view: View, rows: torch.Tensor) -> torch.Tensor:
    """A prompt's rows ``[T, k]`` (positions ``0 .. T - 1``) as the unit states ``[T, d]`` they most likely came from
    (float32)."""
    return (_features(view.settled(rows)) @ back_map(view)).float()
