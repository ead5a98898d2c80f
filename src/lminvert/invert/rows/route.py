"""The route :func:`lminvert.invert` takes for a leak that is not lminvert's own states shipped whole (a KV cache,
states under noise or quantisation, one vector): :class:`.attack.Attack` on the leak's view, its findings as
:class:`lminvert.invert.results.InversionResult`, one per prompt."""

from __future__ import annotations

import torch

from ...models import LoadedModel
from ..acceptor import UNCERTAIN
from ..results import InversionResult, PositionResult
from ..sources import ErrorModel
from ..views import View
from .attack import Attack, Observed, Recovered

POLICY = "rows"  # the rows search's rankers (:mod:`.search`), as results name a policy

DESCRIBED = {
    "states": "layer {layer}'s states",
    "kv": "block {layer}'s KV cache (keys after the rotary embedding, then values; it reads layer {below}'s states)",
    "last": "layer {layer}'s last-position state alone",
}


def invert_rows(
    model: LoadedModel,
    rows: list[torch.Tensor],
    view: View,
    source: ErrorModel,
    notes: tuple[str, ...] = (),
    screen: bool | None = None,
) -> list[InversionResult]:
    """Every prompt's rows ``[T, k]`` (``view``'s, under ``source``) inverted by :class:`.attack.Attack`; ``notes``:
    what every result carries first (how the rows were read); ``screen``: as :func:`lminvert.invert`'s."""
    attack = Attack(view, screen=screen)
    found = attack.run([Observed(r.float().cpu(), source) for r in rows])
    below = view.states_layer.name
    route = f"searched in the space of {DESCRIBED[view.name].format(layer=view.layer.name, below=below)}"
    return [_result(model, view, f, source, (*notes, route)) for f in found]


def _result(
    model: LoadedModel, view: View, found: Recovered, source: ErrorModel, notes: tuple[str, ...]
) -> InversionResult:
    positions = [
        PositionResult(
            token_id=token,
            distance=distance,
            margin=margin,
            tolerance=tolerance,
            candidates_checked=checked,
            uncertain=verdict == UNCERTAIN,
            certified_radius=gap,
            verdict=verdict,
            reason=reason,
        )
        for token, verdict, checked, gap, distance, margin, tolerance, reason in zip(
            found.token_ids,
            found.verdicts,
            found.checked,
            found.half_gaps,
            found.distances,
            found.margins,
            found.tolerances,
            found.reasons,
            strict=True,
        )
    ]
    return InversionResult(
        token_ids=list(found.token_ids),
        text=model.decode(list(found.token_ids)),
        seconds=found.seconds,
        positions=positions,
        layer=view.layer.name,
        model=model.name,
        method="sipit",
        policy=POLICY if found.route == "rows" else found.route,
        vocab_size=model.probe.vocab_size,
        dtype=model.dtype,
        device=str(model.probe.device),
        source=source.label,
        notes=notes,
    )


__all__ = ["POLICY", "invert_rows"]
