"""The smallest gap between two prompts' last states at a layer that a calibration sees: what lets one vector's search
(:mod:`.last`) say ``confident`` for a prompt that fits the error model but does not reproduce the vector bit for bit.

The paper's theorem says distinct prompts give distinct last states; ``lminvert collisions`` measures how far apart.
Here the near pairs are sought where they are likeliest: short calibration prompts with each position swapped for
``SWAPS`` random tokens (at deep layers the first token, an attention sink, moves the last state least), with ``SWAPS``
tokens put in front and without the first token; the smallest distance between any two of each such group, relative
to the farther state's norm (and between unit vectors, for ``--normalised``), is kept per layer. It is a sample's
minimum, not a bound: the exhaustive test's minimum over 1.2e9 pairs (every token appended to one prefix; SmolLM2:
docs/results.md, "Collisions per layer") lies 4-57 times below this sample's at layers 1, 15 and 30, so the acceptor
asks for a margin of :data:`.acceptor.GAP_SAFETY` times beyond it, and never says ``certified`` on it.
"""

from __future__ import annotations

import torch

from ..models import Layer, LoadedModel
from .tables import cached
from .tolerance import calibration_prompts

KIND = "whole-gap2"  # the cache's name for the measurement
LENGTHS = (1, 2, 4, 8)  # the calibration prompts cut to these lengths
SWAPS = 16  # random tokens put in place of each position's, and put in front


def whole_gap(model: LoadedModel, layer: Layer, normalised: bool = False) -> float:
    """The smallest relative gap between two prompts' last states at ``layer`` the calibration saw (``normalised``:
    between their unit vectors), measured once per weights, dtype, device type and layer, and kept."""
    measured = cached(model, layer, KIND, lambda: _measure(model, layer), per_device=True)
    return float(measured[1 if normalised else 0])


def _measure(model: LoadedModel, layer: Layer) -> torch.Tensor:
    probe = model.probe
    gen = torch.Generator().manual_seed(0)
    raw, unit = torch.inf, torch.inf
    for prompt in calibration_prompts(model):
        for n in LENGTHS:
            base = prompt[:n]
            swapped = [base]
            for i in range(n):
                swaps = torch.randint(0, probe.vocab_size, (SWAPS,), generator=gen).tolist()
                swapped += [[*base[:i], t, *base[i + 1 :]] for t in swaps if t != base[i]]
            longer = [[t, *base] for t in torch.randint(0, probe.vocab_size, (SWAPS,), generator=gen).tolist()]
            groups = (swapped, longer, [base[1:]] if n > 1 else [])
            states = torch.cat([_last_states(model, layer, group) for group in groups if group])
            norms = states.norm(dim=1, keepdim=True).clamp_min(1e-300)
            raw = min(raw, _smallest(torch.cdist(states, states) / torch.maximum(norms, norms.T)))
            unit = min(unit, _smallest(torch.cdist(states / norms, states / norms)))
    return torch.tensor([raw, unit], dtype=torch.float64)


def _smallest(distances: torch.Tensor) -> float:
    """The smallest distance between two different prompts' states: off the diagonal, above 0 (a zero is a tied twin's,
    a token whose input vector is another's bit for bit: no state tells them apart, and the search says so itself)."""
    distances = distances.fill_diagonal_(torch.inf)
    return float(distances[distances > 0].min())


def _last_states(model: LoadedModel, layer: Layer, prompts: list[list[int]]) -> torch.Tensor:
    """The last states (float64, CPU) of prompts all of one length, in batches."""
    probe = model.probe
    out = []
    with torch.no_grad():
        for first in range(0, len(prompts), 256):
            ids = torch.tensor(prompts[first : first + 256], device=probe.device)
            out.append(probe.states(ids, [layer])[layer][:, -1].double().cpu())
    return torch.cat(out)
