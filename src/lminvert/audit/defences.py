"""Defences a deployment may put on what it ships (states, a KV cache, an embedding): one small class each.

A defence sees the leak's rows ``[T, D]`` (one per position, as the deployment holds them) and returns a
:class:`Shipped`: what leaves the deployment (what an attacker holds), what the deployment itself goes on computing with
(its utility is measured from that), and what the attacker is assumed to know, as the defence's ``threat`` states.
Add one by subclassing :class:`Defence` and registering it in :data:`DEFENCES`; ``parse_defence`` reads the names
``lminvert audit --defences`` takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LminvertError
from ..invert.sources import Quant
from ..invert.tolerance import add_noise


@dataclass(frozen=True)
class Shipped:
    """The result of a defence on one prompt's rows."""

    rows: torch.Tensor  # [T, k] what leaves the deployment; rows of NaN: positions not shipped
    kept: torch.Tensor  # [T, D] what the deployment goes on computing with
    source: str | None = None  # the error model an attacker inverts the rows with (None: the leak's own)
    public: Callable[[torch.Tensor], torch.Tensor] | None = None  # a map the attacker knows: leak rows -> shipped rows
    permuted: bool = False  # the dimensions were permuted by a secret the attacker does not hold


@dataclass(frozen=True)
class Defence:
    """``apply(rows, generator)`` -> :class:`Shipped`; ``threat``: what the attacker is assumed to know."""

    name: ClassVar[str] = ""
    threat: ClassVar[str] = ""

    @property
    def label(self) -> str:
        return self.name

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        raise NotImplementedError

    def check(self, width: int) -> None:
        """A one-line error if the defence cannot apply to rows of ``width`` numbers."""


@dataclass(frozen=True)
class NoDefence(Defence):
    name: ClassVar[str] = "none"
    threat: ClassVar[str] = "the rows are shipped as computed"

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        return Shipped(rows, rows)


@dataclass(frozen=True)
class GaussianNoise(Defence):
    """Relative Gaussian noise: ``level * ||row|| * g / sqrt(D)`` per row; the deployment computes with the noisy rows
    (split inference: the next party receives them)."""

    level: float = 0.01
    name: ClassVar[str] = "noise"
    threat: ClassVar[str] = "the attacker knows the noise level, not the noise"

    @property
    def label(self) -> str:
        return f"noise:{self.level:g}"

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        noisy = add_noise(rows, self.level, generator)
        return Shipped(noisy, noisy, source=self.label)


@dataclass(frozen=True)
class Quantise(Defence):
    kind: str = "int8"
    name: ClassVar[str] = "quant"
    threat: ClassVar[str] = "the attacker knows the format (bf16, fp16, fp8 e4m3, per-row absmax int8/int4)"

    @property
    def label(self) -> str:
        return f"quant:{self.kind}"

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        stored = Quant(kind=self.kind).quantise(rows)
        return Shipped(stored, stored, source=self.label)


@dataclass(frozen=True)
class Permute(Defence):
    """A secret permutation of the dimensions (one per prompt); the receiving party holds the key and undoes it."""

    name: ClassVar[str] = "permute"
    threat: ClassVar[str] = "the attacker knows the model, not the permutation"

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        order = torch.randperm(rows.shape[-1], generator=generator)
        return Shipped(rows[:, order], rows, permuted=True)


@dataclass(frozen=True)
class Drop(Defence):
    """A stored artefact (a log, a cache dump) keeps only some positions: a ``fraction`` of them, chosen at random,
    are missing (never all). The model's own computation is unchanged."""

    fraction: float = 0.25
    name: ClassVar[str] = "drop"
    threat: ClassVar[str] = "the attacker holds the positions kept, and knows which ones are missing"

    @property
    def label(self) -> str:
        return f"drop:{self.fraction:g}"

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        count = min(len(rows) - 1, round(self.fraction * len(rows)))
        gone = torch.randperm(len(rows), generator=generator)[:count]
        shipped = rows.float().clone()
        shipped[gone] = math.nan
        return Shipped(shipped, rows)


@dataclass(frozen=True)
class Project(Defence):
    """Rows projected to ``k`` dimensions by a fixed orthonormal map (seeded, so public: a bottleneck shipped with the
    model); the receiving party continues from its least-squares reconstruction ``P^T P x``."""

    k: int = 128
    seed: int = 0
    name: ClassVar[str] = "project"
    threat: ClassVar[str] = "the projection is public (it ships with the model)"

    @property
    def label(self) -> str:
        return f"project:{self.k}"

    def check(self, width: int) -> None:
        if not 1 <= self.k <= width:
            raise LminvertError(
                f"project:{self.k} needs k <= {width}, the leak's numbers per position: give a smaller k"
            )

    def matrix(self, width: int) -> torch.Tensor:
        self.check(width)
        gaussian = torch.randn(width, self.k, generator=torch.Generator().manual_seed(self.seed), dtype=torch.float64)
        return torch.linalg.qr(gaussian).Q.T.float()  # [k, width], orthonormal rows

    def apply(self, rows: torch.Tensor, generator: torch.Generator) -> Shipped:
        p = self.matrix(rows.shape[-1])

        def public(x: torch.Tensor) -> torch.Tensor:
            return x.float() @ p.T

        shipped = public(rows)
        return Shipped(shipped, shipped @ p, public=public)


DEFENCES: dict[str, type[Defence]] = {
    cls.name: cls for cls in (NoDefence, GaussianNoise, Quantise, Permute, Drop, Project)
}
DEFAULT = ("none", "noise:0.001", "noise:0.01", "quant:bf16", "quant:fp8", "quant:int8", "quant:int4", "permute")
DEFAULT += ("drop:0.25", "project:128")


def parse_defence(spec: str) -> Defence:
    """The defence a name like ``noise:0.01``, ``quant:int4`` or ``project:128`` gives; a one-line error otherwise."""
    name, _, value = spec.strip().lower().partition(":")
    if name not in DEFENCES:
        raise LminvertError(f"unknown defence '{spec}': use {', '.join(DEFAULT)} (or a registered one)")
    try:
        if name == "noise":
            level = float(value)
            if not (level > 0 and math.isfinite(level)):
                raise ValueError
            return GaussianNoise(level)
        if name == "quant":
            kind = {"8": "int8", "4": "int4"}.get(value, value)
            if kind not in ("bf16", "fp16", "fp8", "int8", "int4"):
                raise ValueError
            return Quantise(kind)
        if name == "drop":
            fraction = float(value)
            if not 0 < fraction < 1:
                raise ValueError
            return Drop(fraction)
        if name == "project":
            k = int(value)
            if k < 1:
                raise ValueError
            return Project(k)
    except ValueError:
        raise LminvertError(
            f"defence '{spec}': give its parameter, e.g. noise:0.01, quant:int8, drop:0.25, project:128"
        ) from None
    if value:
        raise LminvertError(f"defence '{spec}': {name} takes no parameter")
    return DEFENCES[name]()


def perturbation(clean: torch.Tensor, shipped: Shipped) -> list[float | None]:
    """Per position, the norm of what the defence changed in the rows (None where a position is missing; the change in
    the public map's space where there is one; 0 for a permutation, which an attacker who undoes it sees no change
    of)."""
    reference = clean.float() if shipped.public is None else shipped.public(clean)
    if shipped.permuted:
        return [0.0] * len(clean)
    out = (shipped.rows.float() - reference).norm(dim=1).tolist()
    return [None if math.isnan(x) else x for x in out]
