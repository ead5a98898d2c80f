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

from ...forward import prompt_states
from ..reading import reading_maps, training_prompts
from ..tables import cached
from ..views import View

KIND = "back-map1"  # the cache's name (with the view's); a new one whenever the fit changes
RIDGE = 1e-4  # relative to the features' mean squared norm


def _unit(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


def _features(rows: torch.Tensor) -> torch.Tensor:
    """``[n, k + 1]``: each settled row made unit, and a 1."""
    unit = _unit(rows)
    return torch.cat([unit, torch.ones_like(unit[:, :1])], dim=1)


def back_map(view: View) -> torch.Tensor:
    """``W`` ``[k + 1, d]`` (float64, on the CPU): unit states predicted from :func:`_features` of settled rows."""
    layer = view.states_layer

    def build() -> torch.Tensor:
        shared: dict[str, list] = {}
        reading_maps(view.model, [layer], shared)  # the reading's training forward, where its map is not kept yet
        prompts = shared.get("prompts")
        if prompts is None:
            prompts = training_prompts(view.model)
            shared["states"] = prompt_states(view.model, prompts, [layer], progress=False)
        states = torch.cat([s[layer][1:] for s in shared["states"]])  # position 0 is the first-position table's
        x = _features(view.rows_of(states, 0))
        gram = x.T @ x
        penalty = RIDGE * float(gram.diagonal().sum()) / len(x)
        return torch.linalg.solve(gram + penalty * torch.eye(len(gram), dtype=gram.dtype), x.T @ _unit(states))

    return cached(view.model, layer, f"{KIND}-{view.name}", build).double().cpu()


def read_back(view: View, rows: torch.Tensor) -> torch.Tensor:
    """A prompt's rows ``[T, k]`` (positions ``0 .. T - 1``) as the unit states ``[T, d]`` they most likely came from
    (float32)."""
    return (_features(view.settled(rows)) @ back_map(view)).float()
