"""One vector (``--leak last``): the prompt whose last position's state at one layer is a given vector, its length
unknown (an embedding API that pools the last token, a service that keeps one vector per prompt).

The vector determines the prompt (distinct prompts give distinct last states: the paper's theorem, measured by
``lminvert collisions``), but no reading of it names the earlier tokens position by position (docs/results.md, "One
vector"). So the candidates are whole prompts, tried by length (1, 2, .. ``max_length``) and verified in batched
forwards over shared prefix caches (the probe's :meth:`~lminvert.models.LayerProbe.prefixes` and ``continuation``):
length 1 by the first-position table (:func:`.tables.first_table_for`); longer ones from prefixes the model's prior
proposes (:class:`Prior`), each followed by what the vector reads as (:mod:`.reading`) and the prefix's likeliest next
tokens, and where all but one token of a prompt found may be right, that token searched alone
(:meth:`_Search._first_tokens`, :meth:`_Search._refined`). After the first block, whole prompts are first read from
its attention's mixture of value vectors (:mod:`.firstblock`).

Every verdict is the acceptor's, told that its candidates are whole prompts (:attr:`.acceptor.Evidence.whole`):
``certified`` where a forward of the candidate alone reproduces the vector to float32's resolution; ``confident`` where
it fits the error model with twice its distance and the bound under the smallest gap between two prompts' last states
the calibration saw (:mod:`.wholegap`); else ``uncertain`` with the nearest prompt found (the prompts tried do not rule
out those that were not). With ``normalised`` the vector was scaled to unit length, as embedding APIs return it:
directions are compared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import LminvertError
from ..models import Layer, LoadedModel
from ..models.ties import tied_token_groups
from ..paths import clock, past
from . import acceptor
from .acceptor import Evidence, Radii
from .engine import InvertConfig, bound_source, invert_prompt
from .firstblock import first_block
from .prefix_prior import Prior
from .reader import reading_for
from .reading import reading_orders
from .results import InversionResult, PositionResult
from .rows.rankers import Ridge
from .sources import ErrorModel
from .tables import first_position_table, first_table_for
from .tolerance import FLOOR, calibrate, norm
from .wholegap import whole_gap

ROUTE = "last"  # what results name as their policy
CLAIMED = (acceptor.CERTIFIED, acceptor.CONFIDENT)  # verdicts that end a vector's search (no other prompt fits)
KEEP = 64  # nearest verified prompts kept as the acceptor's evidence (the others lie farther than every contender)
CHUNK = 4096  # candidate prompts per verification forward
PREFIXES = 64  # prefixes whose candidates are verified together at first (then about a second's worth: the deadline
# is checked between such batches)
MOST = 4096  # prefixes in one batch at most
SWEPT = 2  # length 2's first tokens past the beam: the vector's readings tried after each
REFINE = 4  # nearest prefixes of each length after which the engine searches the last token (:meth:`_Search._refined`)
RANKED = 256  # candidates the engine may verify for it; first tokens per batch (:meth:`_Search._first_tokens`)
SAMPLES = 1024  # random first tokens whose states start that ridge fit
SWEEP = 0.4  # the part of a length's time its sweep or beam takes
UNIT = 1e-5  # a normalised vector whose norm is within this of 1 is compared as given
NORMALISED = 4.0  # float32's resolution of a unit vector, in its eps: two normalisations (the vector's, a candidate's)
# by different kernels each round a coordinate by a unit in the last place or two
TABLE = 64  # length 1: the tokens whose first-position states lie nearest the vector
FIRST = 0.8  # after the first block: the part of the time its tokens' algebra may take (:mod:`.firstblock`)
LASTS = 2  # ... and the vector's readings it takes for the last token


@dataclass(frozen=True)
class LastOptions:
    """How far the search goes (never what the acceptor accepts): lengths ``1..max_length``; ``firsts``: length 2's
    first tokens in the prior's order (None: as many as the time allows); ``beam``: prefixes kept per longer length;
    ``last``: tokens the vector reads as, tried after every prefix; ``extend``: the prefix's likeliest next tokens tried
    after it, and the beam's extensions of each prefix; ``seconds``: per vector."""

    max_length: int = 8
    normalised: bool = False
    firsts: int | None = None
    beam: int = 256
    last: int = 8
    extend: int = 8
    seconds: float = 60.0


@dataclass
class _Tried:
    """The nearest candidate prompts verified for one vector (at most ``KEEP``): ids, cached distances, states."""

    prompts: list[tuple[int, ...]]
    dists: torch.Tensor
    states: torch.Tensor
    checked: int = 0
    longest: int = 0  # the longest prompts verified
    plain: dict[tuple[int, ...], float] = field(default_factory=dict)  # distances of forwards of a prompt alone

    def add(self, prompts: list[tuple[int, ...]], dists: torch.Tensor, states: torch.Tensor) -> None:
        every = self.prompts + prompts
        dists, states = torch.cat([self.dists, dists]), torch.cat([self.states, states])
        keep = dists.argsort()[:KEEP]
        self.prompts = [every[i] for i in keep.tolist()]
        self.dists, self.states = dists[keep], states[keep]
        self.checked += len(prompts)


def invert_last(
    model: LoadedModel, vectors: list[torch.Tensor], layer: Layer, source: ErrorModel, options: LastOptions,
    notes: tuple[str, ...] = (),
) -> list[InversionResult]:  # fmt: skip
    """Each vector ``[d]`` (a prompt's last state at ``layer``, under ``source``) inverted to a prompt (see the module
    docstring); ``notes``: what every result carries first."""
    for v in vectors:  # NaN and inf are refused where the states are read (:class:`lminvert.states.HiddenStates`)
        if options.normalised and float(v.float().norm()) == 0:
            raise LminvertError("a zero vector has no direction: drop --normalised or give the vector itself")
    search = _Search(model, layer, bound_source(model, layer, source), options)
    return [search.run(v.float().reshape(-1), notes) for v in vectors]


class _Search:
    def __init__(self, model: LoadedModel, layer: Layer, source: ErrorModel, options: LastOptions) -> None:
        self.model, self.layer, self.source, self.options = model, layer, source, options
        self.probe = model.probe
        self.prior = Prior(model)
        self.calibration = calibrate(model, layer)
        self.ties = {t for group in tied_token_groups(model) for t in group}
        self.ridge = Ridge.of(self.probe)
        self.gap: float | None = None  # :mod:`.wholegap`'s, measured where a prompt first fits (once per layer)
        self.first = first_block(model) if layer == 1 else None

    def unit(self, states: torch.Tensor) -> torch.Tensor:
        """States as compared: unit length where the vector was normalised (float32, CPU)."""
        states = states.float().cpu()
        if self.options.normalised:
            states = states / states.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        return states

    def _target(self, vector: torch.Tensor) -> torch.Tensor:
        """The vector as compared: a normalised one as given where it is of unit length already (normalising it again
        would round it once more), else scaled to it."""
        if self.options.normalised and abs(float(vector.double().norm()) - 1) < UNIT:
            return vector.float().cpu()
        return self.unit(vector)

    def run(self, vector: torch.Tensor, notes: tuple[str, ...]) -> InversionResult:
        start, deadline = time.perf_counter(), clock() + self.options.seconds
        target = self._target(vector)
        tried = _Tried([], torch.empty(0, dtype=torch.float64), torch.empty(0, target.numel()))
        decision = acceptor.PENDING
        for prompts in self._candidates(target, deadline, tried):
            self._verified(tried, prompts, target)
            decision = self._decide(tried, target, exhausted=False)
            if decision.verdict in CLAIMED or past(deadline):
                break
        if decision.verdict not in CLAIMED:  # the search is over: the acceptor's verdict on all it verified
            decision = self._decide(tried, target, exhausted=True)
        return self._result(tried, decision, target, time.perf_counter() - start, notes)

    # ------------------------------------------------------------------ candidates
    def _candidates(self, target: torch.Tensor, deadline: float, tried: _Tried) -> Iterator[list[tuple[int, ...]]]:
        """Batches of candidate prompts, shortest first, until ``max_length`` or the deadline. Length 2 may take half
        the time (its first tokens in the prior's order, until its share is spent or ``firsts`` were tried: the one
        length whose first token can be swept), each longer one an equal share of what is left. Each length ends with
        the last tokens its nearest prefixes rank first (:meth:`_refined`; ``tried``: what was verified so far)."""
        reads = self._reads(target)
        yield [(t,) for t in self._firsts(target, reads).tolist()]
        if self.first is not None:  # the first block's algebra (:mod:`.firstblock`), then the search below
            share = clock() + (deadline - clock()) * FIRST
            yield from self.first.proposals(
                target, reads[:LASTS].tolist(), self.options.max_length, share, self.options.normalised
            )
        beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
        size = PREFIXES
        for length in range(2, self.options.max_length + 1):
            now = clock()
            if now > deadline:
                return
            share = now + (deadline - now) / (2 if length == 2 else self.options.max_length - length + 1)
            sweep = now + (share - now) * SWEEP  # the rest of the share: the nearest prompts' one wrong token
            beam = self._grow(beam, length - 1, deadline)
            done = 0
            # a sweep shorter than a second starts with fewer prefixes (a batch of PREFIXES: about a second at a
            # middle layer), so that a small budget is kept to
            size = max(PREFIXES // 16, min(size, int(PREFIXES * (sweep - clock()))))
            while done < len(beam) and clock() < sweep:
                # past the beam (length 2's further first tokens) the prior's next tokens are not asked: a forward of
                # every prefix through every block for each would cost more than the candidates it proposes
                likely = done < self.options.beam
                chunk = beam[done : done + (min(size, self.options.beam - done) if likely else size)]
                started = time.perf_counter()
                yield self._followed([p for p, _ in chunk], reads, likely)
                done += len(chunk)
                took = time.perf_counter() - started  # this batch's verification: batches of about a second each
                size = min(MOST, size * 2) if took < 0.5 else max(PREFIXES // 4, size // 2) if took > 2 else size
            if length == 2:
                yield from self._first_tokens(tried, target, (clock() + share) / 2)
            refined = self._refined(tried, length, target, max(share, min(clock() + 1, deadline)))
            if refined:
                yield refined

    def _firsts(self, target: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
        """Length 1's candidates: the tokens whose first-position states lie nearest (and those the vector reads as).
        A normalised vector has lost the norm a lift to a table of a layer above needs (a state's norm changes what the
        blocks between add to it): it is compared by direction with the layer's own table (built once where none is
        kept: a forward of every token)."""
        probe, layer = self.probe, self.layer
        table = first_table_for(self.model, layer, progress=False)
        if self.options.normalised and table.at != layer:
            rows = first_position_table(self.model, layer, progress=False).float()
            rows, lifted = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30), target.to(rows.device)
        else:
            rows, lifted = table.table.float(), table.lift(target.to(probe.device)).float()
            if self.options.normalised:  # the layer's own (or the final layer's normed) table: directions
                rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
        nearest = (rows - lifted.to(rows.device)).norm(dim=1).topk(TABLE, largest=False).indices.cpu()
        return torch.cat([nearest, reads]).unique(sorted=False)

    def _reads(self, target: torch.Tensor) -> torch.Tensor:
        """The tokens the vector reads as (the layer's reading of a last state, nearest first)."""
        weights = reading_for(self.model, self.layer)
        return reading_orders(self.model, weights, target[None], self.options.last)[0].cpu()

    def _grow(
        self, beam: list[tuple[tuple[int, ...], float]], length: int, deadline: float
    ) -> list[tuple[tuple[int, ...], float]]:
        """The prefixes of ``length`` tokens to try, likeliest first: every first token for length 1 (as many as
        ``firsts``), else the beam's ``extend`` likeliest extensions, ``beam`` of them kept (of the prefixes the prior
        scored before the ``deadline``)."""
        if length == 1:
            order = self.prior.logprobs([()])[0]
            top = order.topk(self.options.firsts or self.probe.vocab_size)
            return [((t,), s) for t, s in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
        logprobs = self.prior.logprobs([p for p, _ in beam[: self.options.beam]], deadline)
        kept = beam[: len(logprobs)]  # those scored within the deadline
        top = logprobs.topk(self.options.extend, dim=1)
        grown = [
            ((*p, t), s + v)
            for (p, s), ts, vs in zip(kept, top.indices.tolist(), top.values.tolist(), strict=True)
            for t, v in zip(ts, vs, strict=True)
        ]
        return sorted(grown, key=lambda item: -item[1])[: self.options.beam]

    def _followed(self, prefixes: list[tuple[int, ...]], reads: torch.Tensor, likely: bool) -> list[tuple[int, ...]]:
        """Each prefix followed by the tokens the vector reads as (and, with ``likely``, by its likeliest next
        tokens)."""
        if not likely:  # a sweep of first tokens: the vector's first two readings after each
            return [(*prefix, t) for prefix in prefixes for t in reads[:SWEPT].tolist()]
        nexts = self.prior.logprobs(prefixes).topk(self.options.extend, dim=1).indices
        out = []
        for prefix, after in zip(prefixes, nexts, strict=True):
            out += [(*prefix, t) for t in torch.cat([reads, after]).unique(sorted=False).tolist()]
        return out

    def _refined(self, tried: _Tried, length: int, target: torch.Tensor, deadline: float) -> list[tuple[int, ...]]:
        """The last token searched by the engine (:func:`.engine.invert_prompt`) after each of the ``REFINE`` nearest
        prefixes of ``length``-token prompts verified so far: where the prefix is right only the last token is wrong,
        and the engine finds a position's token given its prefix (its next-token prior, reading and secant model; at
        most ``RANKED`` candidates). The prefix's own states, computed here, stand for its rows; the vector (scaled
        back to a state's norm where it was normalised) for the last. Its tokens are candidates like any other: the
        engine's verdicts are not used."""
        found = [p for p in tried.prompts if len(p) == length]
        prefixes = list(dict.fromkeys(p[:-1] for p in found))[:REFINE]
        config = InvertConfig(max_candidates=RANKED, deadline=deadline, speculate=False)
        out = []
        for prefix in prefixes:
            if past(deadline):
                break
            rows = self.probe.states(torch.tensor([list(prefix)]), [self.layer])[self.layer][0].float().cpu()
            last = target
            if self.options.normalised:  # the norm of a state after this prefix (its nearest candidate's)
                nearest = next(p for p in found if p[:-1] == prefix)
                last = target * float(self._states([nearest], unit=False)[0].norm())
            result = invert_prompt(self.model, torch.cat([rows, last[None]]), self.layer, config)
            if tuple(result.token_ids[:-1]) == prefix and tuple(result.token_ids) not in found:
                out.append(tuple(result.token_ids))
        return out

    def _first_tokens(self, tried: _Tried, target: torch.Tensor, deadline: float) -> Iterator[list[tuple[int, ...]]]:
        """Length 2's first token searched under each of the ``REFINE`` last tokens of the nearest two-token prompts
        verified so far: the states of ``SAMPLES`` random first tokens before it, then the tokens that a ridge fit of
        the state on the first token's input vector (:class:`.rows.rankers.Ridge`, local: on the nearest) puts
        nearest, ``RANKED`` at a time, refitted on each batch. (A deep layer's last state says little of the first
        token, an attention sink; this ranks it from the states themselves: SmolLM2 layer 15, six two-token prompts,
        the true first token within the first 16 for four.) Verified here, so nothing is yielded but empty batches,
        between which the deadline is checked."""
        lasts = list(dict.fromkeys(p[-1] for p in tried.prompts if len(p) == 2))[:REFINE]
        generator = torch.Generator().manual_seed(0)
        for n, last in enumerate(lasts):
            if past(deadline):
                return
            until = clock() + (deadline - clock()) / (len(lasts) - n)
            ids = torch.randint(0, self.probe.vocab_size, (SAMPLES,), generator=generator)
            states = self._verified(tried, [(int(t), last) for t in ids], target)
            while clock() < until:
                order = self.ridge.order(ids, states, target)
                batch = order[~torch.isin(order, ids)][:RANKED]
                if not len(batch):  # every first token tried under this last one
                    break
                ids = torch.cat([ids, batch])
                states = torch.cat([states, self._verified(tried, [(int(t), last) for t in batch], target)])
                yield []

    # ------------------------------------------------------------------ verification
    def _verified(self, tried: _Tried, prompts: list[tuple[int, ...]], target: torch.Tensor) -> torch.Tensor:
        """``prompts`` (all of one length) verified and kept among the nearest; their states as compared."""
        if not prompts:
            return torch.empty(0, target.numel())
        out = []
        for first in range(0, len(prompts), CHUNK):
            part = prompts[first : first + CHUNK]
            out.append(self._states(part))
            tried.add(part, (out[-1].double() - target.double()).norm(dim=1), out[-1])
        tried.longest = max(tried.longest, len(prompts[0]))
        return torch.cat(out)

    def _states(self, prompts: list[tuple[int, ...]], unit: bool = True) -> torch.Tensor:
        """The last states of ``prompts`` (all of one length) at the layer, as compared (``unit``; else as computed):
        each distinct prefix's cache made once, the last tokens continued over it in one batched forward."""
        compared = self.unit if unit else (lambda states: states.float().cpu())
        probe = self.probe
        if len(prompts[0]) == 1:
            ids = torch.tensor(prompts, device=probe.device)
            return compared(probe.states(ids, [self.layer])[self.layer][:, -1])
        prefixes = list(dict.fromkeys(p[:-1] for p in prompts))
        index = {p: i for i, p in enumerate(prefixes)}
        with torch.no_grad():
            cache = probe.prefixes([list(p) for p in prefixes], self.layer)
            rows = torch.tensor([index[p[:-1]] for p in prompts], device=probe.device) if len(prefixes) > 1 else None
            last = torch.tensor([p[-1] for p in prompts], device=probe.device)
            states = probe.continuation(cache, last, rows=rows)
        assert isinstance(states, torch.Tensor)
        return compared(states)

    def _alone(self, prompt: tuple[int, ...]) -> torch.Tensor:
        """The last state of ``prompt`` from a forward of it alone, shaped as a one-prompt capture's."""
        ids = torch.tensor([list(prompt)], device=self.probe.device)
        return self.unit(self.probe.states(ids, [self.layer])[self.layer][0, -1])

    def _radii(self, target: torch.Tensor, length: int, nearest: float = math.inf) -> Radii:
        """A batched forward's rounding (the calibration's plain radius), the source's bound around ``target`` and,
        where the ``nearest`` prompt's distance lies within them, the smallest gap between two prompts' last states
        (:mod:`.wholegap`; else 0: nothing fits, and the gap is not measured)."""
        rounding = self.calibration.confirm_radius(target)
        bound = self.source.bound(target, length - 1)
        resolution = (NORMALISED if self.options.normalised else 1.0) * FLOOR * norm(target)
        if nearest <= rounding + bound and self.gap is None:
            self.gap = whole_gap(self.model, self.layer, self.options.normalised)
        gap = (self.gap or 0.0) * norm(target)
        return Radii(rounding + bound, rounding + bound, bound, rounding, gap, resolution)

    def _decide(self, tried: _Tried, target: torch.Tensor, exhausted: bool) -> acceptor.Decision:
        """The acceptor's decision on the nearest prompts verified, re-measuring those it asks for by a forward of each
        alone (at most a few rounds)."""
        if not tried.prompts:
            return acceptor.PENDING
        radii = self._radii(target, len(tried.prompts[0]), float(tried.dists.min()))
        while True:  # the re-measured kept by prompt: a later decision asks for none of them again
            plain = {i: tried.plain[p] for i, p in enumerate(tried.prompts) if p in tried.plain}
            evidence = Evidence(
                torch.arange(len(tried.prompts)), tried.dists, tried.states, target, plain, radii.cached,
                self.source.reproducible, exhausted=exhausted, checked=tried.checked, whole=True,
            )  # fmt: skip
            decision = acceptor.decide(evidence, radii)
            if not decision.confirm:
                return decision
            for i in decision.confirm:
                prompt = tried.prompts[i]
                tried.plain[prompt] = float((self._alone(prompt).double() - target.double()).norm())

    def _result(
        self, tried: _Tried, decision: acceptor.Decision, target: torch.Tensor, seconds: float, notes: tuple[str, ...]
    ) -> InversionResult:
        model = self.model
        index = decision.token if decision.token is not None else 0
        prompt = list(tried.prompts[index]) if tried.prompts else []
        tied = any(t in self.ties for t in prompt)
        verdict = acceptor.final_verdict(decision, tied=tied, after_guess=False)
        distance = float(tried.dists[index]) if tried.prompts else math.inf
        tolerance = self._radii(target, max(1, len(prompt))).cached
        positions = [
            PositionResult(
                token_id=t,
                distance=distance,
                margin=math.inf,
                tolerance=tolerance,
                candidates_checked=tried.checked if i == len(prompt) - 1 else 0,  # whole prompts: at the last position
                uncertain=verdict == acceptor.UNCERTAIN,
                verdict=verdict,
                reason=decision.reason,
            )
            for i, t in enumerate(prompt)
        ]
        said = (
            f"one vector: {tried.checked} whole prompts of 1 to {tried.longest} tokens verified; the prompt is the one "
            "given only where it is certified",
        )
        return InversionResult(
            token_ids=prompt, text=model.decode(prompt), seconds=seconds, positions=positions,
            layer=self.layer.name, model=model.name, method="sipit", policy=ROUTE,
            vocab_size=self.probe.vocab_size, dtype=model.dtype, device=str(self.probe.device),
            source=self.source.label, notes=(*notes, *said),
        )  # fmt: skip
