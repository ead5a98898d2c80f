"""The rows search's radii, measured (:func:`measure`): on calibration prompts, how far the cached forward's rows lie
from a plain forward's (rounding) and how far the deployment's own rows lie from the plain forward's (where they were
computed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..invert.tolerance import calibration_prompts
from ..models import LoadedModel
from .running import Running
from .screen import SCREEN_FROM, Screen

Rows = Callable[[torch.Tensor, int], torch.Tensor]  # states [n, d] at a position -> rows [n, k] as shipped


@dataclass(frozen=True)
class Measured:
    """Relative disagreements in the rows' space (see the module docstring)."""

    rounding: float  # cached forward vs plain forward
    first: float  # the deployment's rows vs the plain forward's, at position 0
    rest: float  # the same at later positions
    screen: float | None = None  # a screened batch's rows (bfloat16 GEMMs) vs the plain forward's (None: not measured)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def measure(
    model: LoadedModel, layer, rows_of: Rows, capture: Callable[[list[int]], torch.Tensor], screen: bool = False
) -> Measured:
    """The disagreements on two calibration prompts of 12 tokens (every position measured; the cached forward over a
    prefix made in one forward and over ones grown a token at a time, by a forward and from a batch's keys and values,
    one token and two at a time, as the search runs them; with ``screen``, the true token's row in a screened batch
    of ``SCREEN_FROM`` candidates too)."""
    probe = model.probe
    rounding, first, rest = 0.0, 0.0, 0.0
    screened: float | None = 0.0 if screen else None
    screening = Screen(model, 0.0) if screen else None  # its forward alone: the error is what is measured here
    others = torch.arange(SCREEN_FROM - 1)  # the screened batch's other candidates
    for ids in calibration_prompts(model, n=2, length=12):
        observed = capture(ids)
        plain = probe.states(torch.tensor(ids), [layer])[layer][0]
        forward, kept = Running(model, layer, reuse=False), Running(model, layer)  # grown by a forward / from keys
        for t in range(len(ids)):
            row = rows_of(plain[t : t + 1], t)
            whole = probe.prefix(ids[:t], layer)  # made in one forward
            grown = [forward.prefix(), kept.prefix()] if t else []
            for prefix in [whole, *grown]:
                cached = rows_of(probe.continuation(prefix, torch.tensor([ids[t]])), t)
                rounding = max(rounding, _relative(cached, row))
                if t + 1 < len(ids):  # two tokens at a time (the lookahead's): the second one's row
                    pair = rows_of(probe.chains(prefix, torch.tensor([ids[t : t + 2]]))[0][:, 1], t + 1)
                    rounding = max(rounding, _relative(pair, rows_of(plain[t + 1 : t + 2], t + 1)))
            if t:  # among other candidates, as the search runs them: the keys the next position's prefix grows from
                batch = torch.tensor([ids[t], *ids[:t]])
                rounding = max(rounding, _relative(rows_of(kept.candidates(batch)[:1], t), row))
            if screening is not None and screened is not None and t:
                fast = screening.states(whole, torch.cat([torch.tensor([ids[t]]), others]))
                screened = max(screened, _relative(rows_of(fast[:1], t), row))
            forward.add(ids[t])
            kept.add(ids[t])
            if t == 0:
                first = max(first, _relative(observed[:1], row))
            else:
                rest = max(rest, _relative(observed[t : t + 1], row))
    return Measured(rounding, first, rest, screened)
