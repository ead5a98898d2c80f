"""One prompt's search at one position: proposals, verification, confirmation by the plain forward, the evidence.

The engine (:mod:`.engine`) runs one :class:`PromptSearch` per prompt and batches their work: the candidates of
every prompt in one verification forward, the confirmations of each prompt in one plain forward.

A search gathers evidence and never decides: after each verified batch and each confirmation it hands the acceptor
(:mod:`.acceptor`, where the acceptance rule and every threshold of it are stated) every verified candidate's cached
distance, the plain distances of those re-measured, and the radii of this position (from :mod:`.tolerance`, measured per
model, dtype, layer and device, plus the error model's bound, :mod:`.sources`). The acceptor answers with a token and
its verdict, the contenders to *confirm* (recomputed the way the observer computed them: a plain uncached forward of
prefix + candidate, same dtype, filled to the observed length so that the kernels see the observer's shapes, which on
the same device reproduces the true token's observed state bit for bit; the first alone, then up to
``acceptor.MAX_CONFIRM`` in one forward), or "more candidates". Where the ball is decisive (narrower than a quarter of
the smallest gap), contenders reach ``REACH`` times its radius, at most half that (Gemma-3-270m layer 9, a random-id
prompt's last position: the true token's cached state lay 1.9x the radius away, the prefix's keys having come from a
forward of another shape).

Screening (a float32 model on a CPU with native bfloat16 GEMMs, :mod:`.engine`): a large batch is first computed with
bfloat16 GEMMs; only its candidates whose screened state lies within the screening radius (calibrated like the others,
:func:`.tolerance.screen_calibration`), the closest ``RECHECK``, are verified as above and recorded. The others are
screened out: marked seen, never recorded (neither the acceptor nor a policy looks at their states), and verified in
full before a position's search would end without a decision (:meth:`PromptSearch.propose`), so screening changes which
candidates are verified first, never the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import LayerProbe, NewKeys, Prefix
from ..models.observed import PlainKeys
from ..paths import past
from . import acceptor
from .acceptor import Evidence, Radii
from .context import PositionContext, wide_dtype
from .policies import Policy, SweepPolicy, TablePolicy
from .results import Clock, PositionResult
from .sources import ErrorModel
from .speculation import Speculator
from .tables import FirstTable
from .tolerance import FLOOR, Calibration, norm

SWEEP = SweepPolicy()  # what an exhaustive search verifies once its policy has nothing left to propose
KEEP_KEYS = 16  # candidates inside the ball per batch whose keys and values are kept for the prefix
REACH = 16  # decisive balls: contenders reach this many times its radius (at most half of Radii.apart), confirmed first
RECHECK = 4  # a screened batch's candidates inside the screening radius verified in full (closest first)


@dataclass(frozen=True)
class Settings:
    """What every prompt's search shares."""

    calibration: Calibration
    budget: int  # candidates per position
    vocab: int
    exhaustive: bool  # verify the whole budget, then decide (the brute-force oracle)
    source: ErrorModel
    table: FirstTable | None  # what ranks position 0 (a first-position table), if used
    ties: dict[int, tuple[int, ...]]
    scale: int = 1  # candidate batch sizes relative to a CPU's
    deadline: float | None = None  # the time (paths.clock()) after which a position stops after its first batch
    guess_ends: bool = False  # after a guess, as after the deadline (:attr:`.engine.InvertConfig.guess_ends`)
    # the scout's search (:mod:`.scout`): a confirmation reads the contenders' verified states (no plain forward), and a
    # prompt stops at its first position that fits no candidate
    scouting: bool = False

    def late(self) -> bool:
        """Whether the deadline has passed."""
        return past(self.deadline)


class PromptSearch:
    """The inversion state of one prompt: its policy, observed states and decided positions."""

    def __init__(
        self,
        targets: torch.Tensor,
        policy: Policy,
        settings: Settings,
        generator: torch.Generator,
        clean: torch.Tensor | None = None,
    ) -> None:
        self.targets = targets  # [T, d] float32 on the model's device
        # verifies the next positions' first guesses in chains (:mod:`.speculation`); set by the engine with the prior
        self.speculator: Speculator | None = None
        self.policy = policy
        self.settings = settings
        self.generator = generator
        self.clean = clean
        self.positions: list[PositionResult] = []
        # a position decided by a guess (several tokens fit, or none): every later position is found given that guess,
        # so it is reported uncertain too (:func:`.acceptor.final_verdict`)
        self.guessed = False
        # a position of this prompt was confirmed by a bit-exact reproduction: the observer's shapes and kernels are
        # reproduced here (evidence for the acceptor, :attr:`.acceptor.Evidence.reproduced`)
        self.reproduced = False
        self.fitted = False  # a position of this prompt was certified or confident: the states fit this model
        self.cut = 0  # positions whose search the deadline stopped (:attr:`Settings.deadline`)
        self.first_cut: int | None = None  # the first of them
        self.halted = False  # stopped at a position that fits no candidate (:attr:`Settings.scouting`)
        self.scouted: list[tuple[int, int, int, float]] = []  # the scout's (candidates, forwards, token, margin)
        self.elapsed = 0.0  # this prompt's share of the timed work
        self.ctx: PositionContext | None = None
        self.decision = acceptor.PENDING  # the acceptor's decision at the current position, once final
        self.to_confirm: list[int] = []
        self.plain_keys: PlainKeys | None = None  # the last confirmation's closest sequence's keys (the next's start)

    @property
    def length(self) -> int:
        return int(self.targets.shape[0])

    # ------------------------------------------------------------------ one position
    def begin(self, t: int, probe: LayerProbe, prefix: Prefix, row: int, next_tokens: torch.Tensor | None) -> None:
        target = self.targets[t]
        calibration = self.settings.calibration
        source = self.settings.source.bound(target, t)  # the error model's bound on the observation's error
        self.expected = self.settings.source.measured(target, t)  # that bound's own measurement
        rounding = calibration.radius(target)
        self.radius = rounding + source
        self.confirm_radius = calibration.confirm_radius(target) + source
        screen = calibration.screen_radius(target)
        self.screen_radius = None if screen is None else screen + source  # None: this search is not screened
        self.screened_out: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, screened distances) not verified
        self.unscreening = False  # the policy is spent: the screened-out candidates are being verified in full
        size, fragile = norm(target), self.settings.source.fragile(target, t)
        radii = (self.radius, self.confirm_radius, source, rounding, calibration.gap * size, FLOOR * size, fragile)
        self.radii = Radii(*radii)  # cached, plain, source, rounding, gap, resolution, fragile
        # contenders: inside the ball, or in a decisive one's reach (accepted only when confirmed by the plain forward)
        apart = self.radii.apart
        self.reach = max(self.radius, min(REACH * self.radius, apart / 2)) if self.decisive else self.radius
        self.ctx = PositionContext(
            probe, prefix, row, target, self.radius, t, self.generator, next_tokens, scale=self.settings.scale
        )
        table = self.settings.table
        first = t == 0 and table is not None
        self.active = TablePolicy(table) if first else self.policy
        self.plain: dict[int, float] = {}  # id -> distance of its plain-forward state
        self.confirmed = False  # a confirmation forward ran at this position
        self.exhausted = False
        self.decision = acceptor.PENDING  # the acceptor's, once final
        self.to_confirm = []
        self.keys: dict[int, NewKeys] = {}  # keys and values of candidates verified inside the ball (for the prefix)
        self.given: int | None = None  # the candidate a chain verified here (:mod:`.speculation`)
        self.clock = Clock()

    @property
    def decisive(self) -> bool:
        """The ball is narrower than the smallest gap between tokens' states: one match in it is the token, without
        confirmation (float32; half precision at shallow layers)."""
        return self.radii.decisive

    @property
    def chosen(self) -> int | None:
        """The token the acceptor decided on at this position (None: not decided yet)."""
        return self.decision.token

    @property
    def may_skip_cache(self) -> bool:
        """After :meth:`decide`: the next position has a plain forward's state of a first guess to test, and it would be
        tested (the ball is not decisive), so that position may be decided without a forward over the cache."""
        speculator = self.speculator
        return speculator is not None and speculator.plain_ahead and (speculator.seeded or not self.decisive)

    @property
    def done(self) -> bool:
        return self.chosen is not None or (self.exhausted and not self.to_confirm)

    def propose(self) -> torch.Tensor | None:
        """The next candidates to verify, or None when this position's search is over (budget or policy spent)."""
        ctx = self.ctx
        assert ctx is not None
        ids = None
        ended = self.settings.late() or (self.settings.guess_ends and self.guessed)  # the deadline passed, or a guess
        late = ctx.forwarded > 0 and ended  # one batch at least, so a closest candidate exists
        if late and not self.exhausted:
            self.cut += 1
            self.first_cut = ctx.position if self.first_cut is None else self.first_cut
        # the scout takes position 0 from the table's first batch (its wide ball holds several first tokens)
        first_only = self.settings.scouting and ctx.position == 0 and ctx.forwarded > 0
        if ctx.forwarded < self.settings.budget and not late and not first_only:
            with self.clock("ranking"):
                ids = self.active.propose(ctx)
            if ids is not None and ids.numel():
                ids = ids[~ctx.seen[ids]][: self.settings.budget - ctx.forwarded]
            if self.settings.exhaustive and (ids is None or ids.numel() == 0):  # the policy is spent: sweep the rest
                ids = SWEEP.propose(ctx)[: self.settings.budget - ctx.forwarded]
        # before giving up: the screened-out, in full
        if (ids is None or ids.numel() == 0) and self.screened_out and not late:
            screened_ids, screened = (torch.cat(parts) for parts in zip(*self.screened_out, strict=True))
            ids, self.screened_out, self.unscreening = screened_ids[screened.argsort()], [], True
            ctx.screened -= len(ids)  # counted once, as verified now
        if ids is None or ids.numel() == 0:
            self.exhausted = True
            self._examine()
            return None
        return ids

    @property
    def screens(self) -> bool:
        """Whether this search's next batch may be screened (:mod:`.engine`): a later batch of a position (the first
        one's states, random samples among them, are the data the policy fits its ranking on)."""
        assert self.ctx is not None
        return self.screen_radius is not None and not self.unscreening and self.ctx.rounds >= 1

    def screen_picks(self, states: torch.Tensor) -> torch.Tensor:
        """Indices, in a batch of screened states ``[B, d]``, of the candidates to verify in full: those inside the
        screening radius, the ``RECHECK`` closest."""
        assert self.ctx is not None and self.screen_radius is not None
        dists = self.ctx.distances(states)
        inside = (dists <= self.screen_radius).nonzero().flatten()
        return inside[dists[inside].argsort()[:RECHECK]]

    def screened(
        self, ids: torch.Tensor, states: torch.Tensor, picks: torch.Tensor, verified: torch.Tensor,
        keys_of: Callable[[list[int]], list[NewKeys | None]],
    ) -> None:  # fmt: skip
        """A screened batch: ``ids`` with their screened states ``[B, d]``, of which ``picks`` were verified in full
        (``verified`` ``[k, d]``; ``keys_of(indices)``: the keys and values of ``picks``' entries ``indices``): those
        are recorded; the others are screened out (not proposed again, verified in full before the search gives up),
        and the policy never sees their states (fitted on them, its rankings got worse: Gemma-3-270m layer 18, a
        random-id prompt 39.7 s against 20.1 s; SmolLM2 layer 30 2.22 s against 1.81 s)."""
        assert self.ctx is not None
        rest = torch.ones(len(ids), dtype=torch.bool, device=ids.device)
        rest[picks] = False
        if rest.any():
            self.ctx.seen[ids[rest]] = True
            self.ctx.screened += int(rest.sum())
            self.screened_out.append((ids[rest], self.ctx.distances(states[rest])))
        self.record(ids[picks], verified)  # perhaps none: the position's rounds still count the batch
        inside = self.inside_last()
        if inside:
            self.keep_keys(ids[picks][inside], keys_of(inside))

    def record(self, ids: torch.Tensor, states: torch.Tensor, given: bool = False) -> None:
        """Verified states ``[B, d]`` (float32) of ``ids`` (``given``: a chain's candidate, not the policy's)."""
        assert self.ctx is not None
        self.ctx.record(ids, states, self.ctx.distances(states), given=given)
        if given:
            self.given = int(ids[0])
        if not self.settings.exhaustive:
            self._examine()

    def verified(
        self,
        ids: torch.Tensor,
        states: torch.Tensor,
        keys_of: Callable[[list[int]], list[NewKeys | None]],
        given: bool = False,
    ) -> None:
        """Record a verified batch (:meth:`record`) and keep the keys and values of its candidates inside the ball;
        ``keys_of(indices)``: those of the batch's rows ``indices``."""
        self.record(ids, states, given)
        inside = self.inside_last()
        if inside:
            self.keep_keys(ids[inside], keys_of(inside))

    def given_plain(self, token: int, state: torch.Tensor, keys: NewKeys | None = None) -> None:
        """``token``'s state ``[d]`` at this position from a plain forward shaped like the observer's (a confirmation
        whose fill were first guesses: :mod:`.speculation`): recorded as verified with its plain distance (what a
        confirmation would measure), and ``keys`` (a chain's for the same token, if one verified it) kept."""
        assert self.ctx is not None
        self.plain[token] = float(self.ctx.distances(state[None])[0])  # before record examines it: no confirmation
        if keys is not None:
            self.keys[token] = keys
        self.record(torch.tensor([token], device=state.device), state[None], given=True)

    def inside_last(self) -> list[int]:
        """Indices, in the batch recorded last, of the (at most ``KEEP_KEYS`` closest) candidates inside the ball."""
        assert self.ctx is not None
        dists = self.ctx.dists[-1]
        inside = (dists <= self.reach).nonzero().flatten()
        if len(inside) > KEEP_KEYS:
            inside = inside[dists[inside].argsort()[:KEEP_KEYS]]
        return inside.tolist()

    def keep_keys(self, ids: torch.Tensor, keys: list[NewKeys | None]) -> None:
        """Keep the keys and values of candidates ``ids``: the decided one's extend the prefix without a forward."""
        for token, new in zip(ids.tolist(), keys, strict=True):
            if new is not None:
                self.keys[token] = new

    def confirm(self, ids: list[int], states: torch.Tensor) -> None:
        """Plain-forward states ``[k, d]`` of the contenders ``ids`` asked for in :attr:`to_confirm`."""
        assert self.ctx is not None
        for token, dist in zip(ids, self.ctx.distances(states).tolist(), strict=True):
            self.plain[token] = dist
        self.to_confirm = []
        self.confirmed = True
        if not self.settings.exhaustive or self.exhausted:
            self._examine()

    def evidence(self) -> Evidence:
        """What this position's search knows, for the acceptor."""
        ctx = self.ctx
        assert ctx is not None
        return Evidence(
            ids=ctx.all_ids(),
            dists=ctx.all_dists(),
            states=ctx.all_states,
            target=ctx.target,
            plain=dict(self.plain),
            reach=self.reach,
            reproducible=self.settings.source.reproducible,
            exhaustive=self.settings.exhaustive,
            exhausted=self.exhausted,
            swept=ctx.checked >= self.settings.vocab,
            confirmed=self.confirmed,
            checked=ctx.forwarded,
            ranked=ctx.rounds >= 1 or ctx.checked >= self.settings.vocab,
            fitted=self.fitted,
            reproduced=self.reproduced,
            twins=self.settings.ties,
            expected=self.expected,
            guessed=self.guessed,
            remeasurable=True,
        )

    def _examine(self) -> None:
        """Ask the acceptor: a decision, contenders to confirm, or more candidates."""
        decision = acceptor.decide(self.evidence(), self.radii)
        if decision.final:
            self.decision, self.to_confirm = decision, []
        else:
            self.to_confirm = list(decision.confirm)

    def decide(self) -> int:
        """The token of this position (after the search is done); the policy learns it."""
        ctx = self.ctx
        assert ctx is not None
        if self.active is self.policy:
            self.policy.end_position(ctx)
        token = self.chosen
        self.halted = self.settings.scouting and self.decision.reason in (acceptor.NO_FIT, None)
        if token is None:  # nothing decided (no candidate verified at all): the closest seen
            token = min(self.plain, key=self.plain.__getitem__) if self.plain else ctx.best_id
        self.token = token
        self.policy.accepted(ctx.position, token)
        if self.speculator is not None:
            self.speculator.decided(ctx.position, token)
        return token

    def finish(self) -> PositionResult:
        """The decided position's result (its clock complete: the engine added its shares of the shared work)."""
        ctx, token = self.ctx, self.token
        assert ctx is not None
        ids, dists = ctx.all_ids(), ctx.all_dists()
        mine = ids == token
        distance = float(dists[mine][0])
        others = dists[~mine]
        certified = noise_norm = None
        if self.clean is not None:
            wide = wide_dtype(ctx.device)
            noise_norm = float((ctx.target.to(wide) - self.clean[ctx.position].to(wide)).norm())
            states = ctx.all_states().to(wide)
            gaps = (states[~mine] - states[mine][0]).norm(dim=1)
            certified = float(gaps.min()) / 2 if gaps.numel() else None  # no other candidate checked: no gap known
        entry = self.scouted[ctx.position] if ctx.position < len(self.scouted) else (0, 0, -1, math.inf)
        scouted, ahead, guess, beside = entry
        tied = self.settings.ties.get(token, ())
        verdict = acceptor.final_verdict(self.decision, bool(tied), self.guessed)
        result = PositionResult(
            token_id=token,
            distance=distance,
            margin=min(float(others.min()) if others.numel() else math.inf, beside if guess == token else math.inf),
            tolerance=self.radius,
            candidates_checked=ctx.forwarded + scouted,
            screened_out=ctx.screened,
            scouted=scouted,
            uncertain=verdict == acceptor.UNCERTAIN,
            verdict=verdict,
            reason=self.decision.reason or "no candidate verified",
            noise_norm=noise_norm,
            certified_radius=certified,
            whole_vocabulary=ctx.checked >= self.settings.vocab,
            tied_with=tied,
            confirmed=len(self.plain),
            plain_distance=self.plain.get(token),
            confirm_tolerance=self.confirm_radius,
            speculated=token == self.given,
            stopped=self.first_cut is not None,
            forwards=self.clock.forwards + ahead,
            **self.clock.seconds,
        )
        self.positions.append(result)
        self.guessed = self.guessed or self.decision.guess
        self.fitted = self.fitted or verdict != acceptor.UNCERTAIN
        self.reproduced = self.reproduced or self.plain.get(token) == 0.0
        self.elapsed += self.clock.total
        self.ctx, self.keys = None, {}
        return result
