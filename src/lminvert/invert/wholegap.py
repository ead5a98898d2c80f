"""The smallest gap between two prompts' last states at a layer that a calibration sees: what lets one vector's search
(:mod:`.last`) say ``confident`` for a prompt that fits the error model but does not reproduce the vector bit for bit.

The paper's theorem says distinct prompts give distinct last states; ``lminvert collisions`` measures how far apart.
Here the nearest pairs are sought where they are likeliest: prompts one token apart (each position of short
calibration prompts swapped for ``SWAPS`` random tokens: at deep layers the first token, an attention sink, moves the
last state least), and a prompt beside itself without its first token or with one more in front. The smallest distance
seen, relative to the prompt's last state's norm (and between unit vectors, for ``--normalised``), is kept per layer.
It is a measurement, not a proof: a prompt found within the error bound, with the bound and its own distance together
under half that gap, is ``confident`` (the acceptor's rule; the false-confident rate measured by
``benchmarks/bench_last.py --capture float``), never ``certified``.
"""

from __future__ import annotations

import torch

from ..models import Layer, LoadedModel
from .tables import cached
from .tolerance import calibration_prompts

KIND = "whole-gap1"  # the cache's name for the measurement
LENGTHS = (1, 2, 3, 4, 6, 8)  # the calibration prompts cut to these lengths
SWAPS = 32  # random tokens put in place of each position's


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
            others = []
            for i in range(n):
                swaps = torch.randint(0, probe.vocab_size, (SWAPS,), generator=gen)
                others += [[*base[:i], int(t), *base[i + 1 :]] for t in swaps if int(t) != base[i]]
            shorter = [base[1:]] if n > 1 else []
            longer = [[int(t), *base] for t in torch.randint(0, probe.vocab_size, (SWAPS,), generator=gen)]
            here = _last_states(model, layer, [base])[0]
            states = torch.cat([_last_states(model, layer, group) for group in (others, shorter, longer) if group])
            size = float(here.norm())
            raw = min(raw, float((states - here).norm(dim=1).min()) / size)
            units = states / states.norm(dim=1, keepdim=True)
            unit = min(unit, float((units - here / size).norm(dim=1).min()))
    return torch.tensor([raw, unit], dtype=torch.float64)


def _last_states(model: LoadedModel, layer: Layer, prompts: list[list[int]]) -> torch.Tensor:
    """The last states (float64, CPU) of prompts all of one length, in batches."""
    probe = model.probe
    out = []
    with torch.no_grad():
        for first in range(0, len(prompts), 256):
            ids = torch.tensor(prompts[first : first + 256], device=probe.device)
            out.append(probe.states(ids, [layer])[layer][:, -1].double().cpu())
    return torch.cat(out)
