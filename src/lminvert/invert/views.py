"""What a leak ships, as a function of each position's state: one small class per kind of leak at a layer (a *view*).

* ``states``: every position's residual at layer ``l`` (split inference, activation logging);
* ``kv``: block ``b``'s KV cache, keys after the rotary embedding, then values (:mod:`lminvert.models.kv`); it reads
  the layer-``b - 1`` states;
* ``last``: the last position's state only (an embedding API, a pooled vector).

A view gives, for a prompt: its rows as a deployment computes them (:meth:`View.capture`: the calibration's "observed"
rows) and the same rows computed from candidate states (:meth:`View.rows_of`: what the search compares). Every search
of :mod:`lminvert.invert` compares candidates through a view; a public linear map or a permutation of the rows is
applied on top of it (:mod:`lminvert.invert.rows.attack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LminvertError
from ..models import Layer, LoadedModel
from ..models.kv import KVBlock, kv_block


@dataclass(frozen=True)
class View:
    """A kind of leak at one layer (``layer``: lminvert's numbering; a KV leak's is the block's, 1..L)."""

    model: LoadedModel
    layer: Layer
    name: ClassVar[str] = ""

    @property
    def states_layer(self) -> Layer:
        """The layer whose states determine the rows (the candidates' states are computed there)."""
        return self.layer

    @property
    def width(self) -> int:
        """``k``: numbers per row."""
        return self.model.probe.hidden_size

    def capture(self, token_ids: list[int]) -> torch.Tensor:
        """The rows ``[T, k]`` a deployment holds for a prompt (float32)."""
        probe = self.model.probe
        return probe.states(torch.tensor(token_ids), [self.layer])[self.layer][0].float().cpu()

    def rows_of(self, states: torch.Tensor, position: int) -> torch.Tensor:
        """The rows ``[n, k]`` that states ``[n, d]`` at :attr:`states_layer` give at ``position``."""
        return states.float().cpu()

    @property
    def alone(self) -> bool:
        """Whether a position's row depends on its token and position alone, never on the tokens before it, so that
        a row at any position is a token's row at position 0 moved there by a map that keeps distances
        (:meth:`moved_back` undoes it)."""
        return False

    def moved_back(self, rows: torch.Tensor, position: int) -> torch.Tensor:
        """Rows ``[n, k]`` at ``position`` as the same tokens give them at position 0 (an :attr:`alone` view only;
        a row's distance to another at ``position`` is their moved rows' distance, up to rounding)."""
        raise NotImplementedError(f"a {self.name} view's rows depend on the tokens before them")

    def settled(self, rows: torch.Tensor) -> torch.Tensor:
        """A prompt's rows ``[T, k]`` with what their positions alone do to them undone, so that each is
        :meth:`rows_of` its state at position 0 (the rows themselves where positions do nothing to them)."""
        return rows.float().cpu()


@dataclass(frozen=True)
class StatesView(View):
    name: ClassVar[str] = "states"


@dataclass(frozen=True)
class LastView(View):
    """Only the last position's state: rows ``[1, d]``."""

    name: ClassVar[str] = "last"

    def capture(self, token_ids: list[int]) -> torch.Tensor:
        return super().capture(token_ids)[-1:]


@dataclass(frozen=True)
class KVView(View):
    """Block ``layer``'s keys and values (it reads the layer-``layer - 1`` states)."""

    name: ClassVar[str] = "kv"

    @property
    def block(self) -> KVBlock:
        return kv_block(self.model, int(self.layer))

    @property
    def states_layer(self) -> Layer:
        return self.model.probe.layer(int(self.layer) - 1)

    @property
    def width(self) -> int:
        return self.block.width

    def capture(self, token_ids: list[int]) -> torch.Tensor:
        return self.block.cached(token_ids)

    def rows_of(self, states: torch.Tensor, position: int) -> torch.Tensor:
        return self.block.rows(states, position)

    @property
    def alone(self) -> bool:
        """Block 1 reads the input vectors, which a rotary model gives no position: its keys and values at a position
        are its token's, the keys rotated there (an orthogonal map)."""
        return int(self.layer) == 1

    def settled(self, rows: torch.Tensor) -> torch.Tensor:
        return self.block.settled(rows)

    def moved_back(self, rows: torch.Tensor, position: int) -> torch.Tensor:
        if not self.alone:
            return super().moved_back(rows, position)
        return self.block.turned(rows, position, back=True)


VIEWS: dict[str, type[View]] = {cls.name: cls for cls in (StatesView, KVView, LastView)}


def make_view(name: str, model: LoadedModel, layer: Layer) -> View:
    """The view ``name`` at ``layer``; one-line errors for an unknown name or a KV view at layer 0 or ``final``."""
    if name not in VIEWS:
        raise LminvertError(f"unknown leak '{name}': use {', '.join(VIEWS)}")
    if name == "kv":
        if layer.is_final or int(layer) < 1:
            raise LminvertError(f"a KV cache belongs to blocks 1..{model.probe.n_layers}: drop layer {layer} for kv")
        kv_block(model, int(layer))  # refuses a model without Llama-style attention
    return VIEWS[name](model, layer)
