"""Whether half-precision rows are a float32 computation rounded to half precision for storage, not a half model's.

The two leaks hold the same dtype and need different reading: a half model's states (``--source float`` with the
half model) or a float32 model's states cast (``--source quant:bf16|fp16`` with the float32 model). Position 0's state
depends on its token alone, so a float32 model's state of that token alone, rounded to the rows' dtype, reproduces a
cast row nearly coordinate for coordinate, and a half model's row in a third of them or fewer (SmolLM2, six held-out
prompts: 99.7-100% of the coordinates of float32 rows cast, captured alone or in a left-padded batch, against 12-37%
of a bfloat16 model's rows at layers 1 and 15; 100% against 8-18% at layers 30 and final). This says which error
model reads the rows; the acceptor still decides every token under it.
"""

from __future__ import annotations

import torch

from ..models import Layer, LoadedModel
from .tables import first_position_table
from .views import View

AGREE = 0.9  # the share of position 0's coordinates reproduced bit for bit that says "cast" (>= 0.997 vs <= 0.37)


def cast_agreement(rounded: torch.Tensor, row: torch.Tensor) -> float:
    """The largest share, over ``rounded``'s rows (every token's float32 row at position 0, rounded to a half dtype),
    of the coordinates of ``row`` (a prompt's position-0 row of that dtype's numbers, held in it or a wider one) equal
    to that table row. Every token, not the nearest: at an attention sink the bfloat16 table's nearest 8 missed the
    token whose rounded state matched 99.7% of the row (SmolLM2, layer 15)."""
    return float((rounded == row.to(rounded.device).to(rounded.dtype)).float().mean(1).max())


def is_cast(
    full: LoadedModel, rows: list[torch.Tensor], layer: Layer, dtype: torch.dtype, view: View | None = None,
    positions: list[int] | None = None,
) -> bool:  # fmt: skip
    """Whether every prompt's position-0 row (``rows``) is ``full``'s float32 computation of a token rounded to
    ``dtype``: :func:`cast_agreement` at least :data:`AGREE` for each, over the float32 first-position table at
    ``layer`` (built once where it is not kept; the float32 search of cast rows starts from it too), or, for a
    ``view``'s rows (a KV cache's), that table's rows through the view at each prompt's ``positions`` (its first
    row's position in the saved sequence: left padding rotates its keys there; 0 where not given)."""
    states = first_position_table(full, layer if view is None else view.states_layer, progress=False)
    tables: dict[int, torch.Tensor] = {}
    for i, row in enumerate(rows):
        at = positions[i] if positions else 0
        if at not in tables:  # rounded once per position, whatever the number of prompts there
            tables[at] = (states if view is None else view.rows_of(states, at)).to(dtype)
        if cast_agreement(tables[at], row) < AGREE:
            return False
    return bool(rows)
