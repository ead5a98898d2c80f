"""The rows search's radii, measured (:class:`Calibration`): on calibration prompts, how far the cached forward's rows
lie from a plain forward's (rounding), how far the deployment's own rows lie from the plain forward's (where they were
computed), and how far a screened forward's rows lie from the plain forward's (:mod:`.screen`). The forwards run once
per model, dtype, layer and device type (kept beside the tables), and are read through the leak's rows and any public
map of them (a projection): every leak's and map's radii come from the same states. :func:`calibrate_rows` runs them
for several layers at once, in the forwards of the highest (what an audit's units read: a layer's states there are
those of a forward that stops at it, bit for bit, as :func:`lminvert.invert.tolerance.measure_layers` measures the
engine's radii)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...models import Layer, LoadedModel
from ..layouts import foreign_calibration
from ..nearest import near_inputs
from ..tables import cached, kept
from ..tolerance import HARD, calibration_prompts
from .running import Running
from .screen import SCREEN_FROM, screened_states

Rows = Callable[[torch.Tensor, int], torch.Tensor]  # states [n, d] at a position -> rows [n, k] as shipped
Map = Callable[[torch.Tensor], torch.Tensor]  # a public map of the rows (rows [n, k] -> [n, m])
Pair = tuple[int, torch.Tensor, torch.Tensor]  # a position, what was compared there [1, *], the plain states [1, d]
KIND, SCREEN_KIND = "audit-calibration1", "audit-screen1"  # the cache's names: new ones whenever what is run changes
GAP_KIND = "rows-gap4"  # every calibration position's true token and OTHERS others, by the cached forward (3: 31,
# over a grown prefix; 4: the true token's nearest input vectors among them)
OTHERS = 31  # candidates beside the true token at each position, for the gap (one forward of 32 per position): the
# true token's tolerance.HARD nearest input vectors by angle (:func:`..nearest.near_inputs`), then random ones
OBSERVED_KIND = "rows-observed1"  # a named view's deployment rows of the calibration prompts (with the view's name)


@dataclass(frozen=True)
class Measured:
    """Relative disagreements in the rows' space (see the module docstring)."""

    rounding: float  # cached forward vs plain forward
    # the deployment's rows vs the plain forward's, at position 0 (with ``layouts``: and the rows that other layouts'
    # states give, :func:`lminvert.invert.layouts.foreign_calibration` through the view)
    first: float
    rest: float  # the same at later positions
    # the smallest distance from a position's true row to another candidate's, relative to the true row's norm, over
    # every position (the attention sink's too) and OTHERS other candidates at each, as the engine's calibration
    # measures it for states (:mod:`lminvert.invert.tolerance`); 0: not measured (no ball is decisive)
    gap: float = 0.0


def through(rows_of: Rows, public: Map | None) -> Rows:
    """``rows_of`` read through the public map ``public`` (None: ``rows_of`` itself)."""
    return rows_of if public is None else (lambda states, t: public(rows_of(states, t)))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


class Calibration:
    """Four calibration prompts of 12 tokens (:func:`lminvert.invert.tolerance.calibration_prompts`), every position
    measured, for one leak at one layer (``rows_of``: the leak's rows of states; ``capture``: the deployment's rows of
    a prompt). The cached and the screened forwards' states depend on the model, its dtype, the layer and the device
    type alone: they are computed once (the screened ones when first asked for: a search that screens no batch never
    runs them) and kept beside the tables; the deployment's rows are captured anew for every leak."""

    def __init__(
        self, model: LoadedModel, layer, rows_of: Rows, capture: Callable[[list[int]], torch.Tensor],
        name: str | None = None,
    ) -> None:  # fmt: skip
        """``name``: the view's (``states``, ``kv``, ...), where ``capture`` is that view's own: its rows of the
        calibration prompts are then kept beside the tables too (None: captured anew for every calibration)."""
        self.model, self.layer, self.rows_of, self.capture, self.name = model, layer, rows_of, capture, name
        self._cached: list[Pair] | None = None  # cached forwards' states beside the plain forward's
        self._observed: list[Pair] | None = None  # the deployment's rows beside the plain forward's states
        self._screened: list[Pair] | None = None  # screened states beside the plain forward's
        self._others: list[tuple[int, torch.Tensor]] | None = None  # a position, its true token's states then others'

    @functools.cached_property
    def prompts(self) -> list[list[int]]:
        return _prompts(self.model)

    @functools.cached_property
    def plains(self) -> list[torch.Tensor]:
        """Each prompt's plain forward's states ``[T, d]`` at the layer (on the CPU)."""
        return [p[self.layer] for p in _plains(self.model, [self.layer], self.prompts)]

    def measured(self, public: Map | None = None, layouts: bool = False) -> Measured:
        """The rounding and the deployment's disagreement, read through ``public`` (None: the rows themselves);
        ``layouts``: and other layouts' (padded batches, one thread, eager attention: a named view's rows only)."""
        if self._cached is None:
            self._cached = self._kept(KIND, self._run)
        if self._observed is None:
            self._observed = self._observe()
        rows = through(self.rows_of, public)
        seen = public or (lambda r: r)
        rounding = max(_relative(rows(a, t), rows(b, t)) for t, a, b in self._cached)
        first = max(_relative(seen(a), rows(b, t)) for t, a, b in self._observed if t == 0)
        rest = max(_relative(seen(a), rows(b, t)) for t, a, b in self._observed if t > 0)
        if layouts and public is None and self.name is not None:
            elsewhere = foreign_calibration(self.model, self.layer, self.rows_of, self.name)
            first, rest = max(first, elsewhere.first), max(rest, elsewhere.rest)
        return Measured(rounding, first, rest, self.gap(public))

    def gap(self, public: Map | None = None) -> float:
        """:attr:`Measured.gap` through ``public`` (None: the rows themselves)."""
        if self._others is None:
            self._others = self._kept_others()
        rows, gaps = through(self.rows_of, public), []
        for t, states in self._others:
            found = rows(states, t).double()
            gaps.append(float((found[1:] - found[0]).norm(dim=1).min() / found[0].norm().clamp_min(1e-30)))
        return min(gaps)

    def screened(self, public: Map | None = None) -> float:
        """The relative disagreement of a screened batch's rows (``SCREEN_FROM`` candidates, the true token among
        them), read through ``public``."""
        if self._screened is None:
            self._screened = self._kept(SCREEN_KIND, self._screen)
        rows = through(self.rows_of, public)
        return max(_relative(rows(a, t), rows(b, t)) for t, a, b in self._screened)

    def _kept(self, kind: str, run: Callable[[], list[Pair]]) -> list[Pair]:
        """``run()``'s states, from the cache beside the tables where they are there (per device type)."""

        packed = cached(self.model, self.layer, kind, lambda: _packed(run()), per_device=True).cpu()
        dtype = self.model.probe.dtype
        return [(int(p[0, -1]), p[:1, :-1].to(dtype), p[1:, :-1].to(dtype)) for p in packed]

    def _kept_others(self) -> list[tuple[int, torch.Tensor]]:
        """Per position of every calibration prompt: the cached forward's states ``[1 + OTHERS, d]`` of its true token
        then of ``OTHERS`` other tokens (:func:`_others`), over the prefix grown a token at a time (kept beside the
        tables)."""
        probe, length = self.model.probe, len(self.prompts[0])
        build = lambda: _others(self.model, [self.layer], self.prompts)[self.layer]  # noqa: E731
        kept = cached(self.model, self.layer, GAP_KIND, build, per_device=True).cpu().to(probe.dtype)
        return [(i % length, states) for i, states in enumerate(kept)]

    def _observe(self) -> list[Pair]:
        """The deployment's rows beside the plain forward's states."""
        out: list[Pair] = []
        captured = [self.capture(ids) for ids in self.prompts] if self.name is None else self._captured()
        for ids, plain, observed in zip(self.prompts, self.plains, captured, strict=True):
            out += [(t, observed[t : t + 1], plain[t : t + 1]) for t in range(len(ids))]
        return out

    def _captured(self) -> list[torch.Tensor]:
        """The named view's rows of every calibration prompt (all of one length), from the cache where they are."""

        def build() -> torch.Tensor:
            return torch.stack([self.capture(ids).double() for ids in self.prompts])

        kept = cached(self.model, self.layer, f"{OBSERVED_KIND}-{self.name}", build, per_device=True).cpu()
        return [rows.float() for rows in kept]

    def _screen(self) -> list[Pair]:
        """A screened batch's true token's states beside the plain forward's."""
        others = torch.arange(SCREEN_FROM - 1)  # the screened batch's other candidates
        probe, out = self.model.probe, []
        for ids, plain in zip(self.prompts, self.plains, strict=True):
            for t in range(1, len(ids)):
                batch = torch.cat([torch.tensor([ids[t]]), others])
                fast = screened_states(probe, probe.prefix(ids[:t], self.layer), batch)
                out.append((t, fast[:1].cpu(), plain[t : t + 1]))
        return out

    def _run(self) -> list[Pair]:
        """The cached forward's states of every calibration position beside the plain forward's (:func:`_cached`)."""
        plains = [{self.layer: plain} for plain in self.plains]
        return _cached(self.model, [self.layer], self.prompts, plains)[self.layer]


def calibrate_rows(model: LoadedModel, layers: list[Layer]) -> list[Layer]:
    """The forwards every :class:`Calibration` at ``layers`` runs first (the cached forward's states, the gap's
    candidates), those not kept yet, for all block layers (1..L) among them in the forwards of the highest one; the
    others (layer 0, ``final``) one at a time. What an audit's units would otherwise run one layer at a time (SmolLM2,
    layers 1, 14 and 15: 46 s of cached forwards one at a time, about what layer 15 takes alone). Returns the layers
    whose forwards ran."""
    probe = model.probe
    wanted = sorted({layer for layer in layers if kept(model, layer, KIND, per_device=True) is None
                     or kept(model, layer, GAP_KIND, per_device=True) is None})  # fmt: skip
    blocks = [layer for layer in wanted if 1 <= int(layer) <= probe.n_layers and not layer.is_final]
    groups = [blocks] if blocks else []
    groups += [[layer] for layer in wanted if layer not in blocks]
    prompts = _prompts(model)
    for group in groups:
        pairs = _cached(model, group, prompts, _plains(model, group, prompts))
        others = _others(model, group, prompts)
        for layer in group:
            cached(model, layer, KIND, lambda found=pairs[layer]: _packed(found), per_device=True)
            cached(model, layer, GAP_KIND, lambda found=others[layer]: found, per_device=True)
    return wanted


def _prompts(model: LoadedModel) -> list[list[int]]:
    """The calibration prompts: two of each kind, 12 tokens (:func:`lminvert.invert.tolerance.calibration_prompts`)."""
    return calibration_prompts(model, n=2, length=12)


def _packed(pairs: list[Pair]) -> torch.Tensor:
    """``[N, 2, d + 1]`` float64 (exact for every float dtype): each pair's two states and its position."""
    return torch.stack([torch.cat([torch.cat([a, b]), torch.full((2, 1), t)], 1) for t, a, b in pairs]).double()


def _at(out: torch.Tensor | dict[Layer, torch.Tensor], layers: list[Layer]) -> dict[Layer, torch.Tensor]:
    """A forward's states as a dict by layer (a forward asked for one layer returns its states alone)."""
    return out if isinstance(out, dict) else {layers[0]: out}


def _asked(layers: list[Layer]) -> list[Layer] | None:
    """``layers`` as the probe is asked for them: None for one (the forward's own layer)."""
    return None if len(layers) == 1 else layers


def _plains(model: LoadedModel, layers: list[Layer], prompts: list[list[int]]) -> list[dict[Layer, torch.Tensor]]:
    """Each prompt's plain forward's states ``[T, d]`` at each of ``layers`` (on the CPU)."""
    probe = model.probe
    return [{layer: s[0].cpu() for layer, s in probe.states(torch.tensor(ids), layers).items()} for ids in prompts]


def _cached(
    model: LoadedModel, layers: list[Layer], prompts: list[list[int]], plains: list[dict[Layer, torch.Tensor]]
) -> dict[Layer, list[Pair]]:
    """At each of ``layers``, the cached forward over a prefix made in one forward and over ones grown a token at a
    time, by a forward (up to the layer: the blocks above change no key below it) and from a batch's keys and values,
    one token and two at a time (the lookahead's: the second one's row), as the search runs them, and among other
    candidates: the keys the prefix grows from; all in the forwards of the highest layer."""
    probe, top, asked = model.probe, max(layers), _asked(layers)
    out: dict[Layer, list[Pair]] = {layer: [] for layer in layers}

    def add(t: int, states: torch.Tensor | dict[Layer, torch.Tensor], plain: dict[Layer, torch.Tensor]) -> None:
        for layer, found in _at(states, layers).items():
            out[layer].append((t, found.cpu(), plain[layer][t : t + 1]))

    for ids, plain in zip(prompts, plains, strict=True):
        grown, running = probe.prefix(ids[:1], top), Running(model, top)
        for t in range(len(ids)):
            for prefix in [probe.prefix(ids[:t], top), *([grown, running.prefix()] if t else [])]:
                add(t, probe.continuation(prefix, torch.tensor([ids[t]]), layers=asked), plain)
                if t + 1 < len(ids):
                    pair = _at(probe.chains(prefix, torch.tensor([ids[t : t + 2]]), layers=asked)[0], layers)
                    add(t + 1, {layer: states[:, 1] for layer, states in pair.items()}, plain)
            if t:
                ran = running.candidates(torch.tensor([ids[t], *ids[:t]]), layers=asked)
                add(t, {layer: states[:1] for layer, states in _at(ran, layers).items()}, plain)
                grown = probe.extend(grown, ids[t])
            running.add(ids[t])
    return out


def _others(model: LoadedModel, layers: list[Layer], prompts: list[list[int]]) -> dict[Layer, torch.Tensor]:
    """At each of ``layers``, per position of every prompt: the cached forward's states ``[1 + OTHERS, d]`` of its true
    token then of ``OTHERS`` other tokens (its nearest input vectors, then random ones), over the prefix grown a token
    at a time, as the search grows it (``[prompts * T, 1 + OTHERS, d]`` float64: exact for every float dtype); in the
    forwards of the highest layer."""
    probe, top, asked = model.probe, max(layers), _asked(layers)
    gen, out = torch.Generator().manual_seed(0), {layer: [] for layer in layers}
    for ids in prompts:
        prefix = probe.prefix([], top)
        near = near_inputs(model, torch.tensor(ids), HARD)  # [T, HARD]
        for t in range(len(ids)):
            others = torch.randint(0, probe.vocab_size - 1, (OTHERS - HARD,), generator=gen)
            batch = torch.cat([torch.tensor([ids[t]]), near[t], others + (others >= ids[t]).long()])  # not the true one
            with torch.no_grad():
                found = _at(probe.continuation(prefix, batch.to(probe.device), layers=asked), layers)
                # the prefix grown a token at a time, as the search grows it
                prefix = probe.prefix(ids[:1], top) if t == 0 else probe.extend(prefix, ids[t])
            for layer, states in found.items():
                out[layer].append(states.cpu().double())
    return {layer: torch.stack(states) for layer, states in out.items()}
