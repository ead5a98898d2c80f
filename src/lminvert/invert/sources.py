"""Error models: how far an observed state may lie from the state a plain forward of the true prompt gives.

States lminvert encoded itself are reproduced bit for bit by a plain forward shaped like the encoder's (``exact``).
A leak never is: a deployment's padded batches, another machine's kernels, another library, a defence that adds noise
or quantises. Each :class:`ErrorModel` states, per position, an absolute L2 bound on ``||observed - h||`` where ``h`` is
this machine's plain forward of the true prefix + token; :mod:`.acceptor` decides with it. Names (``--source``):

* ``exact``   - lminvert's own ``encode``: bound 0 (the engine's own rounding is calibrated apart, :mod:`.tolerance`);
* ``float``   - computed elsewhere in the same dtype (another batch layout, kernel, thread count or library): the
  largest relative disagreement measured on this machine across such layouts (:func:`.layouts.foreign_calibration`),
  first position and later positions apart, times ``SAFETY``;
* ``noise:S`` - relative Gaussian noise of level ``S`` (``S * ||h|| * g / sqrt(d)``): its norm's 5-sigma bound,
  from the observed state (:func:`.tolerance.noise_tolerance`), plus ``float``'s (the noise was added to states
  computed somewhere; not where lminvert adds it to its own states, ``invert(noise=S)``);
* ``quant:B`` - per-token quantisation of the states: ``int8``/``int4`` (or ``8``/``4``: symmetric absmax),
  ``bf16`` (a cast), ``fp8`` (e4m3, each token scaled so that its absmax maps to 448): the worst-case rounding of
  that format, plus ``float``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import LminvertError
from ..models.compat import CASTS
from ..states import HiddenStates
from .tolerance import FLOOR, SAFETY, add_noise, noise_tolerance, norm

# mantissa bits of the float formats ``quant:`` names: a rounded coordinate is within 2^-(bits+1) of its value
MANTISSA = {"bf16": 7, "fp16": 10, "fp8": 3}
# the file dtype a cast to a half format stores (the rows of a float32 computation saved as ``float16``/``bfloat16``)
STORED = {kind: dtype for dtype, kind in CASTS.items()}
# float16 flushes magnitudes below 2^-14 to its subnormals, a fixed step of 2^-24: half of it bounds that part of the
# error, per coordinate, apart from the relative one
FP16_SUBNORMAL = 2.0**-25
# fp8 e4m3 flushes magnitudes below its smallest subnormal (2^-9; the largest is 448) to zero: that part of the
# error is bounded apart, per coordinate, by half the subnormal step relative to the token's absmax
FP8_SUBNORMAL = 2.0**-9 / 448.0


@dataclass(frozen=True)
class ErrorModel:
    """A source of states: ``bound(target, position)`` bounds ``||observed - h||`` (absolute, L2)."""

    name: str = "exact"
    reproducible: bool = True  # a plain forward shaped like the observer's can give the observation bit for bit
    first: float = 0.0  # relative disagreement allowed at position 0 by how the states were computed
    rest: float = 0.0  # the same at later positions
    # the same at sink-like later positions: (norm, relative) pairs, each a floor over ``rest`` for a target whose norm
    # is at least that (:class:`.layouts.Disagreement`)
    bands: tuple[tuple[float, float], ...] = ()
    elsewhere: bool = False  # computed elsewhere: ``float``'s measured disagreement is part of the bound
    # the observation may still be a plain forward's bit for bit (``float``: computed elsewhere, perhaps as lminvert
    # computes it; not under noise or quantisation), so a candidate that reproduces it is evidence
    bitwise: bool = True

    def computed(self, target: torch.Tensor, position: int) -> float:
        """The part of the bound that comes from where the states were computed (``float``'s calibration)."""
        size = norm(target)
        rel = self.first if position == 0 else max([self.rest, *(r for top, r in self.bands if size >= top)])
        return SAFETY * max(rel, FLOOR) * size if rel > 0 else 0.0

    def bound(self, target: torch.Tensor, position: int) -> float:
        return self.computed(target, position)

    def fragile(self, target: torch.Tensor, position: int) -> bool:
        """Whether the bound here is a sink-like band's (:class:`.layouts.Disagreement`), wider than ``rest``: the
        state is dominated by a few huge coordinates that amplify where it was computed, so its own row does not
        choose among tokens, short of reproducing it (:attr:`lminvert.invert.acceptor.Radii.fragile`)."""
        size = norm(target) if self.bands and position > 0 else 0.0
        return any(size >= top and r > self.rest for top, r in self.bands)

    def measured(self, target: torch.Tensor, position: int) -> float:
        """How far the true token's state lay from the observation in the measurement the bound was made from (the
        bound without its safety factor; inf where the model states no such figure): a candidate that fits only beyond
        it fits through the slack (:attr:`lminvert.invert.acceptor.Evidence.expected`)."""
        return math.inf

    def distances(self, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """How far each candidate row ``[n, k]`` lies from the observed ``target`` ``[k]`` beyond what the error model
        allows coordinate by coordinate (float64 ``[n]``): L2 here. Every such distance is 1-Lipschitz in the candidate
        row (a row within ``e`` in L2 of another lies within ``e`` of its distance), so rounding radii add to it."""
        return (rows.double() - target.double()).norm(dim=-1)

    def distance_bound(self, target: torch.Tensor, position: int) -> float:
        """The bound on the true row's :meth:`distances` at ``position``: :meth:`bound` where they are L2."""
        return self.bound(target, position)

    def simulate(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``rows`` ``[T, k]`` (a plain forward's) as this source may ship them, for measuring a rule on calibration
        prompts: relative Gaussian noise at the measured disagreement where the states were computed (``first`` at
        position 0, ``rest`` later; nothing for ``exact``)."""
        rel = torch.tensor([self.first] + [self.rest] * (len(rows) - 1), dtype=torch.float64)[:, None]
        return add_noise(rows.float(), rel, generator)

    @property
    def boxed(self) -> bool:
        """:meth:`distances` are measured beyond a box the model allows per coordinate (a distance of 0 then says the
        row fits, not that it reproduces the observation)."""
        return False

    def order(self, table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Every candidate row of ``table`` ``[V, k]``, the likeliest to have given the observed ``row`` first (an
        order to try them in, never a verdict): nearest in L2."""
        return (table.double() - row.double()).norm(dim=1).argsort()

    @property
    def needs_calibration(self) -> bool:
        """Whether :meth:`calibrated` must be given the foreign layouts' measurement."""
        return self.elsewhere

    def calibrated(self, first: float, rest: float, bands: tuple[tuple[float, float], ...] = ()) -> ErrorModel:
        """This model with the measured foreign disagreements (:func:`.layouts.foreign_calibration`)."""
        return replace(self, first=first, rest=rest, bands=bands)

    @property
    def label(self) -> str:
        """The ``--source`` string naming this model."""
        return self.name

    @property
    def stored(self) -> str | None:
        """The dtype the rows were stored in by this model's own rounding (a cast of a float32 computation to a half
        format: ``quant:bf16``, ``quant:fp16``), which a float32 model reads; None for any other."""
        return None


@dataclass(frozen=True)
class Exact(ErrorModel):
    """lminvert's own states: reproduced bit for bit."""


@dataclass(frozen=True)
class Float(ErrorModel):
    """States computed elsewhere in the model's dtype."""

    name: str = "float"
    reproducible: bool = False
    elsewhere: bool = True

    def measured(self, target: torch.Tensor, position: int) -> float:
        return self.computed(target, position) / SAFETY


@dataclass(frozen=True)
class Noise(ErrorModel):
    """Relative Gaussian noise of level ``sigma`` on states computed elsewhere."""

    name: str = "noise"
    reproducible: bool = False
    elsewhere: bool = True
    bitwise: bool = False
    sigma: float = 0.0

    def bound(self, target: torch.Tensor, position: int) -> float:
        return noise_tolerance(target, self.sigma) + self.computed(target, position)

    @property
    def label(self) -> str:
        return f"noise:{self.sigma:g}"

    def simulate(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return add_noise(super().simulate(rows, generator), self.sigma, generator)


@dataclass(frozen=True)
class Quant(ErrorModel):
    """Per-token quantisation of states computed elsewhere: ``int8``/``int4`` absmax, or ``bf16``/``fp16``/``fp8``
    (``bf16`` and ``fp16``: also a float32 computation's rows saved in ``bfloat16``/``float16``, :attr:`stored`)."""

    name: str = "quant"
    reproducible: bool = False
    bitwise: bool = False
    elsewhere: bool = True
    kind: str = "int8"

    def bound(self, target: torch.Tensor, position: int) -> float:
        x = target.detach().float()
        if self.kind in MANTISSA:
            rel = 2.0 ** -(MANTISSA[self.kind] + 1)
            # the observed value is the rounded one: |v| <= |observed| / (1 - rel), so the error is within that
            rounding = rel / (1 - rel) * norm(x)
            if self.kind == "fp8":
                rounding += math.sqrt(x.numel()) * FP8_SUBNORMAL * float(x.abs().max()) / (1 - rel)
            if self.kind == "fp16":
                rounding += math.sqrt(x.numel()) * FP16_SUBNORMAL
        else:
            levels = 2 ** (int(self.kind.removeprefix("int")) - 1) - 1
            # the observed absmax is the true one rounded to itself (it maps to +-levels): the step is exact
            step = float(x.abs().max()) / levels
            rounding = math.sqrt(x.numel()) * step / 2
        return rounding + self.computed(target, position)

    @property
    def label(self) -> str:
        return f"quant:{self.kind}"

    @property
    def stored(self) -> str | None:
        return STORED.get(self.kind)

    def simulate(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.quantise(super().simulate(rows, generator))

    def quantise(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-row quantisation, as stored: ``bf16`` and ``fp16`` (a cast), ``fp8`` (e4m3, each row scaled so that its
        absmax maps to 448), ``int8``/``int4`` (symmetric absmax per row); returned in float32."""
        x = rows.float()
        if self.kind in STORED:
            return x.to(getattr(torch, STORED[self.kind])).float()
        absmax = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if self.kind == "fp8":
            scale = 448.0 / absmax
            return (x * scale).to(torch.float8_e4m3fn).float() / scale
        levels = 2 ** (int(self.kind.removeprefix("int")) - 1) - 1
        step = absmax / levels
        return (x / step).round().clamp(-levels, levels) * step

    def half_widths(self, target: torch.Tensor) -> torch.Tensor:
        """Per coordinate, how far the value before quantisation may lie from the observed ``target`` (float64
        ``[k]``): half the absmax step (``int8``/``int4``: the observed absmax is the true one, exactly), or half a
        unit in the last place of the rounded value (``bf16``/``fp16``/``fp8``, fp8's and fp16's subnormal steps beside
        it)."""
        x = target.detach().double()
        if self.kind in MANTISSA:
            rel = 2.0 ** -(MANTISSA[self.kind] + 1)
            half = rel / (1 - rel) * x.abs()
            if self.kind == "fp8":
                half = half + FP8_SUBNORMAL * float(x.abs().max()) / (1 - rel)
            if self.kind == "fp16":
                half = half + FP16_SUBNORMAL
            return half
        levels = 2 ** (int(self.kind.removeprefix("int")) - 1) - 1
        return torch.full_like(x, float(x.abs().max()) / levels / 2)

    def distances(self, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """L2 beyond the quantisation's box (:meth:`half_widths`): ``||max(|row - target| - half, 0)||``. The true row
        lies inside the box but for where it was computed (``float``'s part), while a wrong row, even one nearer in L2
        than the quantisation error's norm, leaves it in many coordinates (SmolLM2 layer 15, int8: the L2 ball of
        position 0 holds 31,000 first tokens)."""
        gap = (rows.double() - target.double()).abs() - self.half_widths(target)
        return gap.clamp_min(0).norm(dim=-1)

    def distance_bound(self, target: torch.Tensor, position: int) -> float:
        """Only where the row was computed (``float``'s part) moves the true row out of the box."""
        return self.computed(target, position)

    @property
    def boxed(self) -> bool:
        return True

    def order(self, table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Nearest first by :meth:`distances` (in plain L2 the quantisation error of an attention sink's huge values
        can hide the true token among hundreds: SmolLM2 layer 15, int8, the first token 418th nearest); ties (rows
        inside the box) broken by the distance once quantised as the observed row was."""
        inside = self.distances(table, row)
        quantised = (self.quantise(table).double() - row.double()).norm(dim=1)
        order = quantised.argsort(stable=True)
        return order[inside[order].argsort(stable=True)]


SOURCES = ("exact", "float", "noise:SIGMA", "quant:int8|int4|bf16|fp16|fp8")


def default_source(states: HiddenStates) -> ErrorModel:
    """The error model of ``states`` given without one: ``exact`` for lminvert's own (a states file records the weights
    that computed it), ``float`` for states from elsewhere."""
    return Exact() if states.weights_hash is not None else Float()


def parse_source(spec: str) -> ErrorModel:
    """The error model a ``--source`` string names (see the module docstring); a one-line error otherwise."""
    text = spec.strip().lower()
    if text == "exact":
        return Exact()
    if text == "float":
        return Float()
    kind, _, value = text.partition(":")
    if kind == "noise":
        try:
            sigma = float(value)
        except ValueError:
            sigma = -1.0
        if not (sigma > 0 and math.isfinite(sigma)):
            raise LminvertError(f"source '{spec}': noise needs a positive relative level, e.g. noise:0.01")
        return Noise(sigma=sigma)
    if kind == "quant":
        aliases = {"8": "int8", "4": "int4", "bfloat16": "bf16", "float16": "fp16", "fp8_e4m3": "fp8", "e4m3": "fp8"}
        name = aliases.get(value, value)
        if name not in ("int8", "int4", *MANTISSA):
            raise LminvertError(f"source '{spec}': quant takes int8, int4, bf16, fp16 or fp8, e.g. quant:int8")
        return Quant(kind=name)
    raise LminvertError(f"unknown source '{spec}': use one of {', '.join(SOURCES)}")
