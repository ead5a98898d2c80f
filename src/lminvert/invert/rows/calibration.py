"""The rows search's radii, measured (:class:`Calibration`): on calibration prompts, how far the cached forward's rows
lie from a plain forward's (rounding), how far the deployment's own rows lie from the plain forward's (where they were
computed), and how far a screened forward's rows lie from the plain forward's (:mod:`.screen`). The forwards run once
per model, dtype, layer and device type (kept beside the tables), and are read through the leak's rows and any public
map of them (a projection): every leak's and map's radii come from the same states."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...models import LoadedModel
from ..layouts import foreign_calibration
from ..tables import cached
from ..tolerance import calibration_prompts
from .running import Running
from .screen import SCREEN_FROM, screened_states

Rows = Callable[[torch.Tensor, int], torch.Tensor]  # states [n, d] at a position -> rows [n, k] as shipped
Map = Callable[[torch.Tensor], torch.Tensor]  # a public map of the rows (rows [n, k] -> [n, m])
Pair = tuple[int, torch.Tensor, torch.Tensor]  # a position, what was compared there [1, *], the plain states [1, d]
KIND, SCREEN_KIND = "audit-calibration1", "audit-screen1"  # the cache's names: new ones whenever what is run changes
GAP_KIND = "rows-gap3"  # every calibration position's true token and OTHERS random ones, by the cached forward (3: 31,
# over a grown prefix)
OTHERS = 31  # random candidates beside the true token at each position, for the gap (one forward of 32 per position)
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
    # every position (the attention sink's too) and OTHERS random candidates at each, as the engine's calibration
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
        return calibration_prompts(self.model, n=2, length=12)

    @functools.cached_property
    def plains(self) -> list[torch.Tensor]:
        """Each prompt's plain forward's states ``[T, d]`` at the layer (on the CPU)."""
        probe = self.model.probe
        return [probe.states(torch.tensor(ids), [self.layer])[self.layer][0].cpu() for ids in self.prompts]

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
            first, rest = max(first, elsewhere[0]), max(rest, elsewhere[1])
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

        def build() -> torch.Tensor:  # [N, 2, d + 1] float64 (exact for every float dtype): the position beside
            return torch.stack([torch.cat([torch.cat([a, b]), torch.full((2, 1), t)], 1) for t, a, b in run()]).double()

        packed = cached(self.model, self.layer, kind, build, per_device=True).cpu()
        dtype = self.model.probe.dtype
        return [(int(p[0, -1]), p[:1, :-1].to(dtype), p[1:, :-1].to(dtype)) for p in packed]

    def _kept_others(self) -> list[tuple[int, torch.Tensor]]:
        """Per position of every calibration prompt: the cached forward's states ``[1 + OTHERS, d]`` of its true token
        then of ``OTHERS`` random other tokens, over the prefix grown a token at a time (kept beside the tables)."""
        probe, length = self.model.probe, len(self.prompts[0])

        def build() -> torch.Tensor:  # [prompts * T, 1 + OTHERS, d] float64 (exact for every float dtype)
            gen, out = torch.Generator().manual_seed(0), []
            for ids in self.prompts:
                prefix = probe.prefix([], self.layer)
                for t in range(length):
                    others = torch.randint(0, probe.vocab_size - 1, (OTHERS,), generator=gen)
                    batch = torch.cat([torch.tensor([ids[t]]), others + (others >= ids[t]).long()])  # never the true
                    with torch.no_grad():
                        out.append(probe.continuation(prefix, batch.to(probe.device)).cpu().double())
                        # the prefix grown a token at a time, as the search grows it
                        prefix = probe.prefix(ids[:1], self.layer) if t == 0 else probe.extend(prefix, ids[t])
            return torch.stack(out)

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
        """The cached forward over a prefix made in one forward and over ones grown a token at a time, by a forward
        (up to the layer: the blocks above change no key below it) and from a batch's keys and values, one token and
        two at a time (the lookahead's: the second one's row), as the search runs them, and among other candidates:
        the keys the prefix grows from."""
        probe, layer = self.model.probe, self.layer
        out: list[Pair] = []
        for ids, plain in zip(self.prompts, self.plains, strict=True):
            grown, kept = probe.prefix(ids[:1], layer), Running(self.model, layer)
            for t in range(len(ids)):
                for prefix in [probe.prefix(ids[:t], layer), *([grown, kept.prefix()] if t else [])]:
                    out.append((t, probe.continuation(prefix, torch.tensor([ids[t]])).cpu(), plain[t : t + 1]))
                    if t + 1 < len(ids):
                        pair = probe.chains(prefix, torch.tensor([ids[t : t + 2]]))[0][:, 1].cpu()
                        out.append((t + 1, pair, plain[t + 1 : t + 2]))
                if t:
                    out.append((t, kept.candidates(torch.tensor([ids[t], *ids[:t]]))[:1].cpu(), plain[t : t + 1]))
                    grown = probe.extend(grown, ids[t])
                kept.add(ids[t])
        return out
