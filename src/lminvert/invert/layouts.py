"""States computed in other layouts than a plain forward of each prompt alone (padded batches, one batch, one thread,
eager attention: what a deployment or another library may run), and how far they lie from it: the measured
disagreement that the ``float`` error model (:mod:`.sources`) scales into its bound."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..forward import padded_batch, padded_positions
from ..models import Layer, LoadedModel
from ..models.hf_internals import attn_implementation
from ..models.observed import attention
from .tables import cached
from .tolerance import calibration_prompts

FOREIGN_KIND = "foreign2"  # the cache's name for the foreign layouts' disagreement; a new name when measured anew
# (2: left-padded rows' positions counted from their first token)
FOREIGN_LENGTHS = (0, 3, 6)  # tokens cut from the calibration prompts' ends in the padded batches (mixed lengths)


def _layouts(model: LoadedModel, layer: Layer, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per layout, every prompt's states ``[T_i, d]`` computed the ways a deployment or another library may: one padded
    batch of mixed lengths (right, then left padding), all prompts in one unpadded batch, each alone on one thread, and
    (where the model does not run it already) the eager attention in a padded batch."""
    probe = model.probe
    cut = [p[: len(p) - FOREIGN_LENGTHS[i % len(FOREIGN_LENGTHS)]] for i, p in enumerate(prompts)]
    out = []
    for side in ("right", "left"):
        out.append(padded_states(probe, layer, cut, side))
    out.append(list(probe.states(torch.tensor(prompts), [layer])[layer].float().cpu()))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out.append([probe.states(torch.tensor(p), [layer])[layer][0].float().cpu() for p in prompts])
    finally:
        torch.set_num_threads(threads)
    if attn_implementation(probe.model.config) not in (None, "eager"):
        with attention(probe, "eager"):
            out.append(padded_states(probe, layer, cut, "right"))
    return out


def padded_states(probe, layer: Layer, prompts: list[list[int]], side: str) -> list[torch.Tensor]:
    """Every prompt's states from one batch padded on ``side`` (pad id 0, masked; each row's positions counted from its
    first real token: :func:`lminvert.forward.padded_positions`)."""
    ids, mask = padded_batch(prompts, range(len(prompts)), side)
    positions = padded_positions(ids, mask)
    states = probe.states(ids, [layer], attention_mask=mask, position_ids=positions)[layer].float().cpu()
    if mask is None:
        return list(states)
    return [states[i][mask[i].bool()] for i in range(len(prompts))]


def foreign_calibration(
    model: LoadedModel,
    layer: Layer,
    rows_of: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    name: str | None = None,
) -> tuple[float, float]:
    """The largest relative disagreement ``||foreign - h|| / ||h||`` of states computed in another layout
    (:func:`_layouts`) with each prompt's plain forward alone, at position 0 and at later positions (cached beside
    the tables, per device type). What the ``float`` error model (:mod:`.sources`) scales into its bound. With
    ``rows_of`` (states ``[n, d]`` at a position -> a leak's rows, e.g. a KV cache's) and that view's ``name``, the
    disagreement of the rows the layouts' states give, measured through the view."""

    def build() -> torch.Tensor:
        prompts = calibration_prompts(model)
        probe = model.probe
        reference = [probe.states(torch.tensor(p), [layer])[layer][0].float().cpu() for p in prompts]
        first, rest = 0.0, 0.0
        for layout in _layouts(model, layer, prompts):
            for ref, got in zip(reference, layout, strict=True):
                h = ref[: len(got)]
                if rows_of is not None:
                    h = torch.cat([rows_of(h[t : t + 1], t) for t in range(len(h))])
                    got = torch.cat([rows_of(got[t : t + 1], t) for t in range(len(got))])
                h = h.double()
                norms = h.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
                rel = (got.double() - h).norm(dim=1) / norms
                first, rest = max(first, float(rel[0])), max(rest, float(rel[1:].max()) if len(rel) > 1 else 0.0)
        return torch.tensor([first, rest], dtype=torch.float64)

    kind = FOREIGN_KIND if rows_of is None else f"{FOREIGN_KIND}-{name}"
    values = cached(model, layer, kind, build, per_device=True).tolist()
    return float(values[0]), float(values[1])
