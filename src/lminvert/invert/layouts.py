"""States computed in other layouts than a plain forward of each prompt alone (padded batches, one batch, one thread,
eager attention: what a deployment or another library may run), and how far they lie from it: the measured
disagreement that the ``float`` error model (:mod:`.sources`) scales into its bound."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..forward import padded_batch, padded_positions
from ..models import Layer, LoadedModel
from ..models.hf_internals import attn_implementation
from ..models.observed import attention
from .tables import cached
from .tolerance import calibration_prompts

FOREIGN_KIND = "foreign3"  # the cache's name for the foreign layouts' disagreement; a new name when measured anew
# (2: left-padded rows' positions counted from their first token; 3: the bands of sink-like positions)
FOREIGN_LENGTHS = (0, 3, 6)  # tokens cut from the calibration prompts' ends in the padded batches (mixed lengths)


# a later position whose norm is this many times the layer's typical later norm is sink-like, and its disagreement is
# measured apart, band by band (a state dominated by a few huge coordinates, an attention sink, amplifies rounding:
# SmolLM2 bfloat16, eager attention against the default kernel on 256 random-id prompts, relative disagreements up to
# 2.05 at layer 15 and 0.97 at layer 30 there, against 0.31 and 0.46 at every other later position; the gaps between
# tokens' states at a sink are 0.5-6% of its norm, so a bound made on the other positions let a wrong token be
# ``confident`` at 3 of 10 such prompts' second positions)
SINK_BANDS = (1.5, 2.0, 3.0, 4.0, 8.0)
SINK_PROMPTS = (256, 20)  # random-id prompts (how many, how long) the bands are measured on, every layer alike
SINK_SEED = 1729
SINK_CHUNK = 64  # prompts per forward


@dataclass(frozen=True)
class Disagreement:
    """The largest relative disagreement of states computed in other layouts with each prompt's plain forward alone:
    ``first`` at position 0, ``rest`` at later positions, and ``bands``: ``(norm, relative)`` pairs, the disagreement
    measured at later positions whose norm is at least ``norm`` (sink-like: :data:`SINK_BANDS` times the layer's
    typical later norm; relative to the foreign state's own norm; non-decreasing), each a floor over ``rest`` there."""

    first: float
    rest: float
    bands: tuple[tuple[float, float], ...] = ()


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
) -> Disagreement:
    """The largest relative disagreement ``||foreign - h|| / ||h||`` of states computed in another layout
    (:func:`_layouts`) with each prompt's plain forward alone, at position 0 and at later positions, and (states
    only) at sink-like positions band by band (:func:`sink_bands`); cached beside the tables, per device type. What
    the ``float`` error model (:mod:`.sources`) scales into its bound. With ``rows_of`` (states ``[n, d]`` at a
    position -> a leak's rows, e.g. a KV cache's) and that view's ``name``, the disagreement of the rows the layouts'
    states give, measured through the view (no bands: a row's norm there does not say it is a sink's)."""

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
        bands = sink_bands(model, layer) if rows_of is None else torch.zeros(0, dtype=torch.float64)
        return torch.cat([torch.tensor([first, rest], dtype=torch.float64), bands])

    kind = FOREIGN_KIND if rows_of is None else f"{FOREIGN_KIND}-{name}"
    values = cached(model, layer, kind, build, per_device=True).tolist()
    bands = ()
    if len(values) > 2:
        typical, rels = values[2], values[3:]
        bands = tuple((edge * typical, rel) for edge, rel in zip(SINK_BANDS, rels, strict=True) if rel > 0)
    return Disagreement(float(values[0]), float(values[1]), bands)


def other_attention(probe) -> str | None:
    """The attention implementation a capture elsewhere is measured with: transformers' eager attention, or PyTorch's
    SDPA where the model runs eager (None: its config names no implementation)."""
    runs = attn_implementation(probe.model.config)
    return None if runs is None else "sdpa" if runs == "eager" else "eager"


def sink_bands(model: LoadedModel, layer: Layer) -> torch.Tensor:
    """``[typical, rel_1, ..., rel_B]``: the median norm of later positions of :data:`SINK_PROMPTS` random-id prompts'
    plain states, and per band of :data:`SINK_BANDS` the largest disagreement ``||foreign - h|| / ||foreign||`` of the
    eager attention's states (PyTorch's SDPA where the model runs eager; none where its config names no
    implementation: the bands are 0) at later positions whose foreign norm lies in the band, made non-decreasing (a band
    sees what every band below it saw)."""
    probe = model.probe
    count, length = SINK_PROMPTS
    ids = torch.randint(0, probe.vocab_size, (count, length), generator=torch.Generator().manual_seed(SINK_SEED))
    plain, foreign = [], []
    other = other_attention(probe)
    for chunk in ids.split(SINK_CHUNK):
        plain.append(probe.states(chunk, [layer])[layer].float().cpu()[:, 1:])
        if other is not None:
            with attention(probe, other):
                foreign.append(probe.states(chunk, [layer])[layer].float().cpu()[:, 1:])
    h = torch.cat(plain).double().flatten(0, 1)
    typical = float(h.norm(dim=1).median())
    rels = torch.zeros(len(SINK_BANDS), dtype=torch.float64)
    if foreign:
        got = torch.cat(foreign).double().flatten(0, 1)
        size = got.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        rel, ratio = (got - h).norm(dim=1) / size, size / max(typical, torch.finfo(torch.float64).tiny)
        for k, edge in enumerate(SINK_BANDS):
            top = SINK_BANDS[k + 1] if k + 1 < len(SINK_BANDS) else float("inf")
            inside = (ratio >= edge) & (ratio < top)
            rels[k] = float(rel[inside].max()) if inside.any() else 0.0
        rels = torch.cummax(rels, dim=0).values
    return torch.cat([torch.tensor([typical], dtype=torch.float64), rels])
