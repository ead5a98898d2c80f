"""What an attacker holds, one small class per kind of leak at a layer: ``states`` (every position's residual, as split
inference or activation logging ship it), ``kv`` (a block's KV cache, keys after the rotary embedding) and ``last``
(the last position's state only, as an embedding API ships it).

A leak gives, for a prompt: its rows as the deployment holds them (:meth:`Leak.capture`), the same rows computed from
candidate states (:meth:`Leak.rows_of`: what the attack compares), and what the deployment's output becomes when it
computes with defended rows (:meth:`Leak.outputs`: next-token logits at every position).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LminvertError
from ..models import Layer, LoadedModel
from ..models.kv import KVBlock, kv_block


@dataclass(frozen=True)
class Leak:
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
        """``D``: numbers per row."""
        return self.model.probe.hidden_size

    def capture(self, token_ids: list[int]) -> torch.Tensor:
        """The rows ``[T, D]`` the deployment holds for a prompt (float32)."""
        probe = self.model.probe
        return probe.states(torch.tensor(token_ids), [self.layer])[self.layer][0].float().cpu()

    def rows_of(self, states: torch.Tensor, position: int) -> torch.Tensor:
        """The rows ``[n, D]`` that states ``[n, d]`` at :attr:`states_layer` give at ``position``."""
        return states.float().cpu()

    def outputs(self, token_ids: list[int], kept: torch.Tensor | None) -> torch.Tensor:
        """Next-token logits ``[T, V]`` of the deployment computing with ``kept`` rows (None: as computed)."""
        probe = self.model.probe
        ids = torch.tensor([token_ids], device=probe.device)
        with torch.no_grad():
            if kept is None:
                return self.model.model(input_ids=ids).logits[0].float().cpu()
            final = probe.final_from(kept, self.layer)
            return probe.next_token_logits(final[0], normed=True).float().cpu()


@dataclass(frozen=True)
class StatesLeak(Leak):
    name: ClassVar[str] = "states"


@dataclass(frozen=True)
class LastLeak(Leak):
    """Only the last position's state: rows ``[1, d]``; the deployment's output is that position's."""

    name: ClassVar[str] = "last"

    def capture(self, token_ids: list[int]) -> torch.Tensor:
        return super().capture(token_ids)[-1:]

    def outputs(self, token_ids: list[int], kept: torch.Tensor | None) -> torch.Tensor:
        if kept is None:
            return super().outputs(token_ids, None)[-1:]
        states = super().capture(token_ids)
        states[-1:] = kept
        return super().outputs(token_ids, states)[-1:]


@dataclass(frozen=True)
class KVLeak(Leak):
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

    def outputs(self, token_ids: list[int], kept: torch.Tensor | None) -> torch.Tensor:
        replaced = contextlib.nullcontext() if kept is None else self.block.replaced(kept)
        with replaced:
            return Leak.outputs(self, token_ids, None)


LEAKS: dict[str, type[Leak]] = {cls.name: cls for cls in (StatesLeak, KVLeak, LastLeak)}


def make_leak(name: str, model: LoadedModel, layer: Layer) -> Leak:
    """The leak ``name`` at ``layer``; one-line errors for an unknown name or a KV leak at layer 0."""
    if name not in LEAKS:
        raise LminvertError(f"unknown leak '{name}': use {', '.join(LEAKS)}")
    if name == "kv":
        if int(layer) < 1 or layer.is_final:
            raise LminvertError(f"a KV cache belongs to blocks 1..{model.probe.n_layers}: drop layer {layer} for kv")
        kv_block(model, int(layer))  # refuses a model without Llama-style attention
    return LEAKS[name](model, layer)
