"""The one decision: a position's evidence and the source's error model in, a token and a verdict out.

No forwards here. Every mechanism that proposes or verifies candidates (policies, the reading, screening,
speculation, confirmations) only supplies :class:`Evidence`; :func:`decide` alone sets a position's token and verdict,
or says what evidence it still needs (contenders to re-measure by the plain forward, or more candidates).

Distances are L2 from the observed state. A candidate's *cached* distance comes from the engine's batched, cached
forward (rounding within ``Radii.rounding`` of a plain forward's); its *plain* distance, where measured, from a plain
forward of prefix + candidate shaped like the observer's (:mod:`.engine`). ``Radii.source`` is the error model's bound
on how far the observation may lie from the true token's plain state (:mod:`.sources`: 0 for lminvert's own states).

Verdicts, never better than the evidence:

* ``certified`` - the plain forward reproduces the observation to float32's resolution (another token could match as
  well only by a collision), or the ball of an exact source cannot hold two tokens' states (its radius is below a
  quarter of the smallest gap between tokens' states the calibration saw) and holds one, or the whole vocabulary was
  verified and every other token lies outside the error bound (Theorem 3.2);
* ``confident`` - the nearest verified candidate (the ranking's top ones among them), inside the error bound, with
  every other verified candidate beyond a margin (:func:`margin`: ``SEPARATION`` times farther, or outside the error
  bound with slack); a wrong state does not come that much nearer to the observation than the right one's error (the
  rate at which this rule was wrong is measured on calibration prompts under the same error model:
  ``benchmarks/bench_foreign.py``; not at a sink-like state computed elsewhere, ``Radii.fragile``, unless the ball is
  decisive); or a first token that its own row does not choose (several fit), where the next row fits under it alone
  (:func:`chosen_by_next` on :class:`NextRow` evidence, its false-confident rate measured at 0 on calibration prompts
  under the same error model); or a whole prompt (one vector's candidate) in the bound, its distance and the bound
  together far under half the smallest gap between two prompts' last states seen;
* ``uncertain`` - anything else (and other whole prompts that do not reproduce the vector): several
  candidates fit, none fits within the budget, the token has a tied twin
  (bit-identical input vector: no state separates them), or an earlier position was such a guess (several fit, or
  none: every later position was found given a token that may be wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .evidence import NO_FIT, PENDING, Decision, Evidence, NextRow

CERTIFIED, CONFIDENT, UNCERTAIN = "certified", "confident", "uncertain"
VERDICTS = (CERTIFIED, CONFIDENT, UNCERTAIN)
# every other verified candidate must lie this many times farther than the chosen one's plain distance: rounding or
# noise is not aligned with the difference between two tokens' states (the rule since the confirmations came)
SEPARATION = 8.0
# a source that cannot be reproduced: the separation asked is at most the chosen distance plus this many plain radii
# (rounding + the error bound, doubled for slack); it decides under a tight statistical bound (noise: 8x alone left
# every position of SmolLM2 layer 15 under 1% noise uncertain); the float model's bound is loose: the ratio decides
SLACK = 2.0
MAX_CONFIRM = 16  # contenders re-measured by one plain forward per round (closest in angle first; the first: one)
# past the reach (_beyond), a round re-measures as many as before it, up to this many (speed only; 16: fixed rounds):
# SmolLM2 layer 15 bfloat16, a second attention sink, 1,405 re-measured in 60 s in rounds of 16 (docs/results.md)
WIDE_CONFIRM = 512
NEAR = True  # nothing within the reach: the nearest candidates re-measured before the search goes on or ends (_near)
BEYOND = True  # an exact source whose observer was reproduced: re-measure past the reach before a guess (_beyond)
# candidates an exact source's position may verify looking for a bit-exact reproduction once an earlier position of
# the prompt was reproduced (the observer's kernels are reproduced here, so a match that is not exact is suspect)
SEARCH_ON = 4096
PACED, PACE = True, 4  # an exact source's contenders re-measured one per PACE candidates checked (_paced; speed only)
# candidates a position of a source that cannot be reproduced may verify while two candidates fit its error model, or
# while nothing fits and no earlier position fitted (another model or layer, noise above the gaps), or nothing fits
# after a guess; where an earlier position fitted, the whole budget (docs/results.md: ranks past 1,024 at layer 30)
GIVE_UP = 1024
# the same while two fit within each other's margin: a later candidate rarely separates them (position 0's sink under
# 0.1-1% noise holds several first tokens)
RIVALS = 256
# ... SEARCH_ON where an earlier position was reproduced bit for bit (the states fit this model's computation: a capture
# from elsewhere, SmolLM2 bfloat16 layer 30: the exact search of its sink took 2,815 candidates); False: RIVALS alone
REPRODUCED_RIVALS = True
# the same where every candidate that fits lies beyond the error model's own measurement (:attr:`Evidence.expected`)
# and no earlier position was a guess: the true token is likely not verified yet (docs/results.md: it came 5,077th)
FAR = 16384
FAR_CONFIRM = 64  # contenders re-measured at most per position meanwhile
SEVERAL = "several candidates fit the observation"
WHOLE = "the nearest prompt tried, not reproduced: prompts not tried are not ruled out"
WHOLE_GAP = "the one prompt within the error bound: two prompts' states lie farther apart (the calibration's gap)"
FRAGILE = "a sink-like state computed elsewhere, not reproduced: its own row does not choose"
BY_NEXT = "its own row did not choose; the next position's row chose"
GAP_SAFETY = 64  # whole prompts: the gap is a sample's minimum, 4-57x the exhaustive test's (:mod:`.wholegap`)
TOKEN_GAP_SAFETY = 4  # tokens: the gap is a sample's, not each position's nearest (bench_gap.py: up to 1.71x it)
POPULATION = 16  # verified candidates a source not reproduced needs for a ``confident`` outside a decisive ball:
# separation needs runner-ups (SmolLM2 layer 15, foreign bfloat16: a chain's wrong guess alone)


@dataclass(frozen=True)
class Radii:
    """Absolute L2 radii around one observed state."""

    cached: float  # a cached distance within it may be the true token's: engine rounding + source bound
    plain: float  # the same for a plain distance
    source: float  # the error model's bound on ||observation - true plain state||
    rounding: float  # the cached forward's own rounding (a plain distance is at least cached - rounding)
    gap: float  # the smallest gap between two tokens' (whole prompts') states the calibration saw (inf: none seen)
    resolution: float  # float32's resolution at the state's norm
    # the bound is a sink-like state's (:meth:`lminvert.invert.sources.ErrorModel.fragile`): see :func:`_verdict`
    fragile: bool = False

    @property
    def apart(self) -> float:
        """How far apart two tokens' states may be counted on to lie: a quarter of the calibration's gap."""
        return self.gap / TOKEN_GAP_SAFETY

    @property
    def decisive(self) -> bool:
        """The ball cannot hold two tokens' states: one match in it is the token."""
        return self.cached < self.apart


def contenders(evidence: Evidence, radii: Radii) -> list[tuple[int, float]]:
    """(id, cached distance) of the verified candidates that may be the true token: within the reach, not ruled out by
    the plain forward; closest in angle first (half-precision rounding of an attention sink's huge coordinates moves a
    state's norm more than the gaps between tokens' states there, its direction much less)."""
    inside = evidence.by_angle((evidence.dists <= evidence.reach).nonzero().flatten())
    pairs = zip(evidence.ids[inside].tolist(), evidence.dists[inside].tolist(), strict=True)
    return [(i, d) for i, d in pairs if evidence.plain.get(i, 0.0) <= radii.plain]


def decide(evidence: Evidence, radii: Radii) -> Decision:
    """The decision at one position given ``evidence`` (see the module docstring)."""
    found = contenders(evidence, radii)
    if not found:
        return _outside(evidence, radii)
    if _fast(evidence, radii, found):
        token = found[0][0]
        proven = evidence.reproducible or (evidence.swept and _alone(evidence, radii, token))
        verdict = CERTIFIED if proven else CONFIDENT
        return Decision(token, verdict, reason="the only match in a ball narrower than the gaps")
    return _reproduced(evidence, radii) or _separated(evidence, radii, found)


def _reproduced(evidence: Evidence, radii: Radii) -> Decision | None:
    """A collision, else the nearest re-measured candidate (in the reach or beyond it) that reproduces the observation
    to float32's resolution, certified (not for an exhaustive search); None: neither, or beyond a box."""
    plain = evidence.plain
    exact = [] if evidence.boxed else sorted((i for i in plain if plain[i] <= radii.resolution), key=plain.__getitem__)
    collided = None if evidence.boxed else _collision(evidence, radii)
    if collided is None and exact and not evidence.exhaustive:
        return Decision(exact[0], CERTIFIED, reason="the plain forward reproduces the observation")
    return collided


def _outside(evidence: Evidence, radii: Radii) -> Decision:
    """Nothing verified within the reach: a re-measured candidate that reproduces the observation is certified (two: a
    collision); else :func:`_near`'s are re-measured; then, where the search ends, the nearest is a guess."""
    if not evidence.exhaustive and (reproduced := _reproduced(evidence, radii)) is not None:
        return reproduced
    ending = evidence.exhausted or (_spent(evidence) and (not evidence.fitted or evidence.guessed))
    if near := _near(evidence, radii, ending):
        return Decision(confirm=tuple(near))
    return _nearest(evidence, UNCERTAIN, NO_FIT, guess=True) if ending else PENDING


def _near(evidence: Evidence, radii: Radii, ending: bool) -> list[int]:
    """Where nothing lies within the reach of a search that can re-measure (:attr:`Evidence.remeasurable`), the
    candidates to re-measure (at most ``MAX_CONFIRM``, closest first, not re-measured yet): those within half the
    tokens' distance apart (Theorem 3.2's Delta/2), the nearest where every other of ``POPULATION`` or more lies
    ``SEPARATION`` times farther, and the nearest before the search ends without a fit. A cached state can lie beyond
    the calibrated radius (SmolLM2 layer 15, 'Patient John, ...': the true token 0.21 away, the radius 0.0072, every
    other token 79 or more; docs/results.md). Evidence only: a re-measured candidate decides only by reproducing the
    observation. Switch: :data:`NEAR`."""
    if not (NEAR and evidence.remeasurable) or evidence.boxed or evidence.exhaustive or not evidence.ids.numel():
        return []
    dists, order = evidence.dists, evidence.dists.argsort()
    within = order[dists[order] <= radii.apart / 2] if math.isfinite(radii.apart) else order[:0]
    if len(order) >= POPULATION and dists[order[1]] > SEPARATION * dists[order[0]]:  # a standout
        within = torch.cat([order[:1], within])
    picked = list(dict.fromkeys(i for i in evidence.ids[within].tolist() if i not in evidence.plain))[:MAX_CONFIRM]
    if picked or not ending:
        return picked
    return [i for i in evidence.ids[order[:MAX_CONFIRM]].tolist() if i not in evidence.plain]


def _fast(evidence: Evidence, radii: Radii, found: list[tuple[int, float]]) -> bool:
    """A single contender in the inner half of a decisive ball, before any confirmation (not for whole prompts)."""
    alone = len(found) == 1 and found[0][1] <= radii.cached / 2 and not evidence.confirmed
    return alone and radii.decisive and not evidence.whole


def _collision(evidence: Evidence, radii: Radii) -> Decision | None:
    """Two contenders (not tied twins) whose plain states both reproduce the observation to float32's resolution: no
    other candidate can make either decisively closer (a model that is not injective)."""
    plain = evidence.plain
    measured = sorted(plain, key=plain.__getitem__)  # those in the reach and beyond it (only matches count below)
    if len(measured) < 2:
        return None
    best, twins = measured[0], set(evidence.twins.get(measured[0], ()))
    if not any(plain[i] <= radii.resolution for i in measured[1:] if i not in twins):
        return None
    return Decision(best, UNCERTAIN, guess=True, reason="two tokens reproduce the observation (a collision)")


def _separated(evidence: Evidence, radii: Radii, found: list[tuple[int, float]]) -> Decision:
    """Confirm the contenders, then take the closest if every other verified candidate lies ``SEPARATION`` times
    farther; before a guess, re-measure past the reach where that may still certify (:func:`_beyond`)."""
    plain = evidence.plain
    measured = [i for i, _ in found if i in plain]
    if evidence.reproducible:  # every contender re-measured (the closest in angle alone first: often the token)
        unmeasured = [i for i, _ in found if i not in plain]
        if unmeasured:
            backlog = PACED and _backlog(evidence, radii)
            if _paced(evidence, backlog):
                return PENDING  # the next candidates first: re-measured, the rest wait (see _paced)
            size = (_wide(plain) if backlog else MAX_CONFIRM) if plain else 1
            return Decision(confirm=tuple(unmeasured[:size]))
    elif not measured:
        return Decision(confirm=(found[0][0],))
    best = min(measured, key=plain.__getitem__)
    bound, twins, rivals = _rivals(evidence, radii, best)
    far = _far(evidence, radii, best, bool(rivals), twins)
    if far is not None:
        return far
    # every other verified candidate, by its plain distance or the least its cached one allows
    unsure = _unsure(evidence, radii, bound, twins)
    if unsure:
        return Decision(confirm=tuple(unsure[:MAX_CONFIRM]))
    if not evidence.reproducible and not evidence.exhausted and not _populated(evidence):
        return PENDING  # separated from what? the ranking's top candidates first
    budget = SEARCH_ON if REPRODUCED_RIVALS and evidence.reproduced else RIVALS
    if rivals and not (evidence.exhausted or _spent(evidence, budget)):
        return PENDING  # a candidate not verified yet may be decisively closer
    decision = Decision(best, UNCERTAIN, guess=True, reason=SEVERAL) if rivals else _verdict(evidence, radii, best)
    beyond = _beyond(evidence, radii, plain[best]) if decision.guess else []
    return Decision(confirm=tuple(beyond[: _wide(plain)])) if beyond else decision


def _rivals(evidence: Evidence, radii: Radii, best: int) -> tuple[float, set[int], list[int]]:
    """``best``'s margin (:func:`margin`), it and its tied twins, the other re-measured candidates within it."""
    plain = evidence.plain
    bound = margin(plain[best], radii, evidence.reproducible, evidence.boxed)
    twins = {best, *evidence.twins.get(best, ())}
    return bound, twins, [i for i, d in plain.items() if i not in twins and d <= bound]


def _paced(evidence: Evidence, backlog: bool) -> bool:
    """Where an exact source's ball holds more contenders than one plain forward re-measures (half precision at deep
    layers: Gemma-3-270m's last layer in bfloat16, the ball 40% of the state's norm, nearly every verified candidate
    in it), whether the contenders not re-measured yet wait for the next candidates: at most ``MAX_CONFIRM`` plus one
    per ``PACE`` candidates checked are re-measured while the search goes on (closest in angle first, so a true token
    verified later, by far the closest, overtakes those waiting); all of them are re-measured before a decision, once
    the candidates are spent, or ``SEARCH_ON`` were checked and no two re-measured candidates lie within each other's
    margin (:func:`_backlog`, given). The order of the evidence only (speed): a token is decided on the same rule.
    Switch: :data:`PACED`."""
    pace = MAX_CONFIRM + evidence.checked // PACE
    return PACED and not backlog and len(evidence.plain) >= pace


def _backlog(evidence: Evidence, radii: Radii) -> bool:
    """The search is at its end: the candidates are spent, or ``SEARCH_ON`` were checked and no rivals keep it going
    (where two are, it goes on to the end anyway: :func:`_separated`); waiting contenders: :func:`_wide` rounds."""
    if evidence.exhausted or evidence.checked < SEARCH_ON:
        return evidence.exhausted
    plain = evidence.plain
    return not (plain and _rivals(evidence, radii, min(plain, key=plain.__getitem__))[2])


def _wide(plain: dict[int, float]) -> int:
    """How many candidates past the reach the next plain forward re-measures (:func:`_beyond`): ``MAX_CONFIRM``, then
    as many as were re-measured so far (at most ``WIDE_CONFIRM``): a few rounds where thousands wait, at most twice the
    forwards' rows the position needed. The contenders within the reach keep rounds of ``MAX_CONFIRM`` (growing them
    too slowed sink prompts whose true token comes among the first few dozen: docs/results.md)."""
    return max(MAX_CONFIRM, min(WIDE_CONFIRM, len(plain)))


def _beyond(evidence: Evidence, radii: Radii, distance: float) -> list[int]:
    """Where the observer's kernels were reproduced at an earlier position (:attr:`Evidence.reproduced`) but no
    re-measured candidate reproduces this one, nearest at ``distance``, in a ball wider than the gaps: every verified
    candidate not re-measured yet, closest in angle first, as the true token's state may lie beyond the reach (SmolLM2
    layer 15, bfloat16, a random-id prompt's second attention sink: the true token's cached state 3,001 away, the ball
    1,021, 2,645 other candidates nearer). Asked only where the position would otherwise be a guess (the ranking's
    own search is over: ``SEARCH_ON`` or no more candidates; asked earlier, the sweep slowed other sink prompts about
    1.5x: thousands re-measured that the ranking's next candidates made needless). Empty elsewhere. Switch:
    :data:`BEYOND`."""
    undecided = _undecided(radii, distance) and distance > radii.resolution
    if not (BEYOND and evidence.reproducible and evidence.reproduced and undecided and not evidence.boxed):
        return []
    rest = torch.tensor([i not in evidence.plain for i in evidence.ids.tolist()], dtype=torch.bool)
    return evidence.ids[evidence.by_angle(rest.nonzero().flatten().to(evidence.ids.device))].tolist()


def _undecided(radii: Radii, distance: float) -> bool:
    """The plain radius is wider than the tokens' distance apart and the nearest re-measured candidate lies at
    ``distance``, beyond half of it (Theorem 3.2's Delta/2): a token not verified yet could match as well."""
    return radii.plain >= radii.apart and distance > radii.apart / 2


def _far(evidence: Evidence, radii: Radii, best: int, rivalled: bool, twins: set[int]) -> Decision | None:
    """Where the nearest re-measured candidate and a rival within its margin (``rivalled``) both fit only through the
    bound's safety factor (beyond :attr:`Evidence.expected`, no earlier position a guess): the true token is likely
    not verified yet, so only candidates that may lie within the expected distance are re-measured, and the search goes
    on up to ``FAR`` before the nearest is a guess (None: not that case; the rivals need no plain forward each)."""
    plain = evidence.plain
    near = evidence.expected + radii.plain - radii.source  # a plain distance within the measurement itself
    if evidence.reproducible or evidence.guessed or not rivalled or plain[best] <= near:
        return None
    # re-measured: candidates whose cached distance itself lies within it, FAR_CONFIRM at most per position (a plain
    # forward each; the cached rounding radius is the calibration's worst times SAFETY, so less it every rival is near)
    closer = [i for i, d in zip(evidence.ids.tolist(), evidence.dists.tolist(), strict=True) if d <= near]
    closer = [i for i in closer if i not in plain and i not in twins][: max(0, FAR_CONFIRM - len(plain))]
    if closer:
        return Decision(confirm=tuple(closer[:MAX_CONFIRM]))
    if evidence.exhausted or _spent(evidence, FAR):
        return Decision(best, UNCERTAIN, guess=True, reason=SEVERAL)
    return PENDING


def margin(distance: float, radii: Radii, reproducible: bool, boxed: bool = False) -> float:
    """How near to the observation another verified candidate may come for the one at ``distance`` to be separated
    from it: ``SEPARATION`` times farther, or (a source that cannot be reproduced) outside the error bound with
    ``SLACK``, whichever is less; beyond a box (``boxed``: the true row's distance is 0 but for where it was computed,
    so no ratio of it separates anything) outside the error bound with ``SLACK`` alone."""
    ratio = SEPARATION * distance + radii.resolution
    if boxed:
        return distance + SLACK * radii.plain
    return ratio if reproducible else min(ratio, distance + SLACK * radii.plain)


def _unsure(evidence: Evidence, radii: Radii, bound: float, skip: set[int]) -> list[int]:
    """Verified candidates not re-measured whose plain distance could be within ``bound`` (their cached distance less
    the rounding), closest first."""
    order = evidence.dists.argsort()
    lower = evidence.dists[order] - radii.rounding
    ids = evidence.ids[order][lower <= bound].tolist()
    return [i for i in ids if i not in skip and i not in evidence.plain]


def _verdict(evidence: Evidence, radii: Radii, best: int) -> Decision:
    """The verdict of a separated contender."""
    distance = evidence.plain[best]
    if evidence.whole:  # not reproduced (that is certified before this)
        # another prompt fitting would need gap <= distance + bound (its state lies the gap or more from this one's)
        if 2 * (distance + radii.plain) * GAP_SAFETY < radii.gap and _alone(evidence, radii, best):
            return Decision(best, CONFIDENT, reason=WHOLE_GAP)
        return Decision(best, UNCERTAIN, guess=True, reason=WHOLE)
    if evidence.reproducible:
        undecided = _undecided(radii, distance)
        if undecided and evidence.reproduced and not evidence.exhausted and evidence.checked < SEARCH_ON:
            return PENDING  # the observer's kernels are reproduced here: look for a candidate that reproduces it
        if undecided:
            return Decision(best, UNCERTAIN, guess=True, reason="not reproduced, in a ball wider than the gaps")
        return Decision(best, CONFIDENT, reason="separated from every other candidate")
    if evidence.swept and _alone(evidence, radii, best):
        return Decision(best, CERTIFIED, reason="the only token of the vocabulary within the error bound")
    if radii.fragile and not radii.decisive:  # a wrong sink state 5x nearer than the true one, ranked past every
        return Decision(best, UNCERTAIN, guess=True, reason=FRAGILE)  # verified one (SmolLM2 bfloat16, eager attention)
    return Decision(best, CONFIDENT, reason="nearest, within the error bound, separated from every other candidate")


def _alone(evidence: Evidence, radii: Radii, best: int) -> bool:
    """Every other verified candidate lies outside the error bound (by its plain distance, or its cached one less the
    rounding): none can be the true token."""
    others = evidence.ids != best
    lower = evidence.dists[others] - radii.rounding
    plain = [d for i, d in evidence.plain.items() if i != best]
    return bool((lower > radii.plain).all()) and all(d > radii.plain for d in plain)


def _populated(evidence: Evidence) -> bool:
    """The ranking's top candidates were verified, ``POPULATION`` of them at least (or the whole vocabulary)."""
    return evidence.swept or (evidence.ranked and int(evidence.ids.numel()) >= POPULATION)


def _spent(evidence: Evidence, budget: int = GIVE_UP) -> bool:
    """A source that cannot be reproduced has verified ``budget`` candidates without a verdict."""
    return evidence.bounded and not evidence.reproducible and not evidence.exhaustive and evidence.checked >= budget


def _nearest(evidence: Evidence, verdict: str, reason: str, guess: bool = False) -> Decision:
    """The closest verified candidate, by its plain distance where one was measured, else its cached one."""
    if not evidence.ids.numel() and not evidence.plain:
        return Decision(reason=reason)
    distance = dict(zip(evidence.ids.tolist(), evidence.dists.tolist(), strict=True)) | evidence.plain
    token = min(distance, key=distance.__getitem__)
    return Decision(token, verdict, guess=guess, reason=reason)


def chosen_by_next(token: int, evidence: NextRow | None = None) -> Decision:
    """A position several tokens fit (or none did, or whose row is missing), ``token`` chosen by how well the next
    position's row fits under it. ``confident`` where ``evidence`` shows that one first token alone lets the next row
    fit: the next row separated it (``confident`` or ``certified``) from every first token its own row allows, the
    next position's own search under it was separated too, the runner-up's own search found no next token that fits,
    and the rule claimed no calibration prompt wrongly (it was measured, and claimed some). Else a guess, ``uncertain``,
    and so is every later position (the next token was found given another first token)."""
    sure = (CERTIFIED, CONFIDENT)
    fits = evidence is not None and evidence.choice.token == token and evidence.covered and not evidence.rival_fits
    fits = fits and evidence.choice.verdict in sure and evidence.following.verdict in sure
    if fits and evidence.calibration is not None and evidence.calibration[0] > 0 and evidence.calibration[1] == 0:
        n = evidence.calibration[0]
        reason = f"the only token under which the next row fits (rule right on {n} of {n} calibration prompts)"
        return Decision(token, CONFIDENT, reason=reason)
    return Decision(token, UNCERTAIN, guess=True, reason=BY_NEXT)


def final_verdict(decision: Decision, tied: bool, after_guess: bool) -> str:
    """The verdict reported for a decided position: ``uncertain`` where the token has a tied twin (no state separates
    them) or an earlier position of the prompt was a guess (everything after it was found given the guess), else the
    decision's (``uncertain`` when nothing was decided)."""
    if tied or after_guess or decision.verdict is None:
        return UNCERTAIN
    return decision.verdict
