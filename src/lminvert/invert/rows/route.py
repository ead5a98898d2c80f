"""The route :func:`lminvert.invert` takes for a leak that is not lminvert's own states shipped whole (a KV cache,
states under noise or quantisation, one vector): :class:`.attack.Attack` on the leak's view, its findings as
:class:`lminvert.invert.results.InversionResult`, one per prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...models import LoadedModel
from ..acceptor import UNCERTAIN
from ..results import InversionResult, PositionResult
from ..sources import ErrorModel
from ..views import KVView, View
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
    offsets: list[int] | None = None,
    deadline: float | None = None,
    known: Sequence[int] = (),
    until: int | None = None,
) -> list[InversionResult]:
    """Every prompt's rows ``[T, k]`` (``view``'s, under ``source``) inverted by :class:`.attack.Attack`; ``notes``:
    what every result carries first (how the rows were read); ``screen``: as :func:`lminvert.invert`'s; ``offsets``:
    a KV cache's left padding per prompt (:func:`aligned`); ``deadline`` (``paths.clock()``): from then on each
    position stops after its first batch of candidates; ``known``: every prompt's first tokens, sure by another
    search, whose positions hold placeholders; ``until``: the positions before it searched alone, the results that
    long (:meth:`.search.RowSearch.run`)."""
    attack = Attack(view, screen=screen)
    offsets = offsets or [0] * len(rows)
    moved = [aligned(attack, r.float().cpu(), o) for r, o in zip(rows, offsets, strict=True)]
    found = attack.run([Observed(r, source) for r, _ in moved], deadline=deadline, known=known, until=until)
    below = view.states_layer.name
    route = f"searched in the space of {DESCRIBED[view.name].format(layer=view.layer.name, below=below)}"
    return [
        _result(model, view, f, source, (*notes, *([] if m is None else [m]), route, *_bound_note(f)))
        for f, (_, m) in zip(found, moved, strict=True)
    ]


def aligned(attack: Attack, rows: torch.Tensor, offset: int) -> tuple[torch.Tensor, str | None]:
    """A KV cache's rows of a prompt that was left-padded by ``offset`` rows in its batch: its keys rotated at the
    positions it would have alone. A batch run with positions counted from its pads (a plain ``model(**batch)``)
    rotated them ``offset`` further; one run with positions from its attention mask (``generate``) did not. The one
    whose position-0 row lies nearer some token's first-position row is taken, and a note says which."""
    if offset == 0:
        return rows, None
    view = attack.leak
    assert isinstance(view, KVView)
    moved = view.block.moved(rows, offset)
    table = attack.table.double()
    near = [float((table - r[0].double()).norm(dim=1).min()) for r in (rows.float(), moved)]
    if near[1] < near[0]:
        return moved, f"left padding of {offset} rows: keys rotated back by {offset} positions (counted from the pads)"
    return rows, f"left padding of {offset} rows: keys already rotated from position 0 (positions from the mask)"


def _bound_note(found: Recovered) -> list[str]:
    """What the time bound did to a prompt's search, where it did anything."""
    if not found.cut:
        return []
    return [
        f"the time bound limited {found.cut} of {len(found.token_ids)} positions to their first batch of candidates, "
        "choosing none by the next row: each kept the acceptor's choice among what it had verified (a position under "
        "way when the bound passed ran to its end); give more time (--max-seconds) before concluding anything"
    ]


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
