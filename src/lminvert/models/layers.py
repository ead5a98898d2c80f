"""Layers of a model as users name them, and the one resolver (:func:`parse_layers`).

``0`` is the input of the first block, ``1..L`` the residual stream after block ``l`` (never passed through the final
norm), negative ``l`` counts from ``L``, ``"middle"`` is ``L // 2`` and ``"final"`` the output of the final norm
(index ``L + 1``). What those states are in a given architecture is the probe's business (:mod:`.probe`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..errors import LminvertError

LayerSpec = int | str  # what users write: 0..L, -1..-L, "final", "middle", or a resolved Layer

DEFAULT_LAYERS = "1,middle,-1"  # first block, middle block, last block: valid for a model of any depth


class Layer(int):
    """A resolved layer of one model: an int ``0..L``, or ``L + 1`` for the output of the final norm.

    Made only by :meth:`LayerProbe.layer` (the one resolver), so a ``Layer`` is always in range for its
    model. It behaves as its index (dict key, file names, arithmetic) and knows its user-facing ``name``.
    """

    n_layers: int

    def __new__(cls, index: int, n_layers: int) -> Layer:
        if not 0 <= index <= n_layers + 1:
            raise ValueError(f"layer index {index} outside 0..{n_layers + 1}")
        value = super().__new__(cls, index)
        value.n_layers = n_layers
        return value

    def __reduce__(self):  # picklable for executors
        return (Layer, (int(self), self.n_layers))

    @property
    def is_final(self) -> bool:
        return int(self) == self.n_layers + 1

    @property
    def name(self) -> str:
        """``"final"`` or the index as text: what files, results and the CLI show."""
        return "final" if self.is_final else str(int(self))

    @property
    def top_block(self) -> int:
        """The highest block (1..L) whose output this layer needs (a KV cache covers blocks 1..top_block)."""
        return min(max(int(self), 1), self.n_layers)

    def __repr__(self) -> str:
        return f"Layer({self.name})"

    def __str__(self) -> str:  # f"{layer}" shows the name ("final" for L + 1); f"{layer:03d}" the index
        return self.name


def _parse_one(spec: LayerSpec, n_layers: int) -> Layer:
    if isinstance(spec, Layer):
        if spec.n_layers != n_layers:
            raise LminvertError(f"layer {spec.name} belongs to a model with {spec.n_layers} layers, not {n_layers}")
        return spec
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "final":
            return Layer(n_layers + 1, n_layers)
        if text == "middle":
            return Layer(max(1, n_layers // 2), n_layers)
        try:
            spec = int(text)
        except ValueError:
            raise LminvertError(
                f"layer '{spec}' is not a layer: use 0..{n_layers}, -1..-{n_layers} from the top, 'middle' or 'final'"
            ) from None
    try:
        if isinstance(spec, bool):
            raise TypeError
        spec = operator.index(spec)
    except TypeError:
        raise LminvertError(f"layer {spec!r} is not a layer: use an int, 'middle' or 'final'") from None
    if not -n_layers <= spec <= n_layers:
        raise LminvertError(
            f"layer {spec} is out of range for this model: use 0..{n_layers} "
            f"(or -1..-{n_layers} from the top, 'middle' or 'final')"
        )
    return Layer(spec % (n_layers + 1) if spec < 0 else spec, n_layers)


def parse_layers(spec: LayerSpec | str | Sequence[LayerSpec], n_layers: int) -> list[Layer]:
    """The one layer resolver. ``spec``: one layer, ``"all"`` (1..L), a comma-separated list such as
    ``"1,middle,-1"``, or a sequence of layers. Returns sorted, distinct :class:`Layer` values; a one-line
    error names the bad entry."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return [Layer(i, n_layers) for i in range(1, n_layers + 1)]
        items: list[LayerSpec] = [part for part in text.split(",") if part.strip()]
    elif isinstance(spec, Sequence):
        items = list(spec)
    else:
        items = [spec]  # one int-like layer (or something that is not a layer: _parse_one says so)
    if not items:
        raise LminvertError(f"no layers given: use 'all', one layer, or a list such as {DEFAULT_LAYERS}")
    return sorted({_parse_one(item, n_layers) for item in items})
