"""The sequential inversion engine (SIPIT): recover token ids position by position, for many prompts at once.

For t = 0..T-1, with the recovered prefixes' KV caches fixed (blocks 1..l only, computed once and extended by one
token per position), each prompt's policy proposes candidate batches; the batches of every prompt still searching
position t are verified together by **one** batched one-position forward (:mod:`.verification`: each candidate row
reads its own prompt's prefix from one batched cache); each prompt's search (:mod:`.search`) applies the acceptance
test and asks for confirmations, which are computed together by one plain forward. Prompts advance in lockstep, so
all prefixes have the same length and share one cache without padding; a prompt that finished position t waits
(costing nothing) for the others. One prompt is the special case N = 1. If nothing passes within the budget, the
closest verified candidate is kept and the position is marked uncertain.

Screening (``InvertConfig.screen``; by default a float32 model on a CPU with native bfloat16 GEMMs): a later batch
of ``verification.SCREEN_FROM`` candidates or more first runs with bfloat16 GEMMs (:meth:`LayerProbe.screening`),
and only its candidates near the target are verified (:mod:`.search`); the prefix keeps float32 keys.

Shared work (a verification forward serving several prompts, the prefix extension, the next-token prior: one
forward of the upper blocks before position 0, counted as position 0's ranking) is split evenly among the prompts
it served in each prompt's time split, so the prompts' seconds add up to the wall time.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..models import Layer, LayerProbe, LayerSpec, LoadedModel, NewKeys, Prefix
from . import scout
from .context import batch_scale
from .fusion import fitted_weight
from .layouts import foreign_calibration
from .misfits import misfit_notes
from .policies import POLICIES, Policy, SweepPolicy
from .proposal import NextTokenPrior
from .reader import reading_for
from .reading import Reading
from .results import KNOWN, InversionResult, PositionResult
from .search import PromptSearch, Settings
from .sinks import shaped
from .sources import ErrorModel, Exact
from .speculation import Speculator, chains_reproduce
from .tables import first_table_for
from .tolerance import Calibration, calibrate, screen_calibration
from .verification import search_position

log = logging.getLogger(__name__)

OnPosition = Callable[[int, int, PositionResult], None]  # (prompt index, position, result)


@dataclass(frozen=True)
class InvertConfig:
    """How to invert. ``method``: ``sipit`` (policy-guided, stops at the first accepted candidate) or
    ``bruteforce`` (verifies the whole vocabulary at every position and takes the arg-min: the oracle).

    ``certify``: verify the whole vocabulary at every position whatever the method, so that a second token whose
    state also matches (a collision: possible only in a model that is not injective) is seen and the position
    flagged. SIPIT's early stop is exact because the model is injective; for a model that may not be (one whose
    computation was edited, e.g. by forward hooks), :func:`lminvert.invert` turns this on by itself."""

    method: str = "sipit"
    certify: bool = False
    policy: str = "linear"
    first_table: bool = True  # rank position 0 with the first-position table (policies that support it)
    max_candidates: int | None = None  # per position; default: the whole vocabulary
    # the time (lminvert.paths.clock()) after which each position stops after its first batch, keeping the closest
    # candidate (the acceptor then rules, as for any budget: such a position is at best what its evidence shows)
    deadline: float | None = None
    # a guess ends the search: every later position gets its first batch only, as past the deadline (a prompt another
    # search takes over where the engine guesses: :func:`.leaks.sink_retry`)
    guess_ends: bool = False
    # every prompt's first tokens, sure by another search (:func:`.leaks.sink_retry`), taken as they are: their
    # positions hold placeholders (uncertain, reason results.KNOWN, no candidate; no scout); prompts are longer
    known: tuple[int, ...] = ()
    tolerance_scale: float = 1.0  # multiplies the measured acceptance radii
    # where the states come from: how far an observation may lie from this machine's plain forward (:mod:`.sources`)
    source: ErrorModel = field(default_factory=Exact)
    seed: int = 0
    progress: bool = False
    # verify the next positions' first guesses in chains (:mod:`.speculation`; speed only), where chains reproduce the
    # observer's rounding (:func:`.speculation.chains_reproduce`: not a half-precision model on a GPU)
    speculate: bool = True
    batch_scale: int | None = None  # candidate batches relative to a CPU's; default: by device (context.batch_scale)
    screen: bool | None = None  # screen large batches with bfloat16 GEMMs (speed only); None: where it pays
    # guess the whole prompt first by a search in bfloat16 GEMMs, checked by one plain forward (:mod:`.scout`; speed
    # only); None: where it pays
    scout: bool | None = None

    def moved(self, seconds: float) -> InvertConfig:
        """This config with its ``deadline`` (if any) ``seconds`` later: a task sent to another process carries it as
        a wall-clock time (``+ paths.clock_offset()``), which that process reads on its own clock (``-`` its own)."""
        return self if self.deadline is None else replace(self, deadline=self.deadline + seconds)

    @property
    def exhaustive(self) -> bool:
        """Whether every position verifies the whole vocabulary (brute force, or ``certify``)."""
        return self.method == "bruteforce" or self.certify


def bound_source(model: LoadedModel, layer: Layer, source: ErrorModel) -> ErrorModel:
    """``source`` with this model's measured foreign disagreements where its bound needs them (cached)."""
    if not source.needs_calibration:
        return source
    measured = foreign_calibration(model, layer)
    return source.calibrated(measured.first, measured.rest, measured.bands)


def _make_policy(config: InvertConfig) -> Policy:
    if config.exhaustive:
        return SweepPolicy()
    return POLICIES[config.policy]()


def invert_prompt(
    model: LoadedModel,
    states: torch.Tensor,
    layer: LayerSpec,
    config: InvertConfig = InvertConfig(),
    policy: Policy | None = None,
    clean_states: torch.Tensor | None = None,
    on_position: Callable[[int, PositionResult], None] | None = None,
    ties: dict[int, tuple[int, ...]] | None = None,
) -> InversionResult:
    """Recover the token ids whose layer-``layer`` states are ``states`` ``[T, d]``."""
    callback = None if on_position is None else (lambda i, t, r: on_position(t, r))
    (result,) = invert_prompts(
        model,
        [states],
        layer,
        config,
        policies=None if policy is None else [policy],
        clean_states=[clean_states],
        on_position=callback,
        ties=ties,
    )
    return result


def invert_prompts(
    model: LoadedModel,
    states: Sequence[torch.Tensor],
    layer: LayerSpec,
    config: InvertConfig = InvertConfig(),
    policies: Sequence[Policy] | None = None,
    clean_states: Sequence[torch.Tensor | None] | None = None,
    on_position: OnPosition | None = None,
    ties: dict[int, tuple[int, ...]] | None = None,
    calibration: Calibration | None = None,
    scouting: bool = False,
    given_prior: NextTokenPrior | None = None,
) -> list[InversionResult]:
    """Recover the token ids of N prompts from their layer-``layer`` states ``[T_i, d]``, advanced together.
    ``calibration``, ``scouting`` and ``given_prior``: the scout's radii, its way of searching
    (:attr:`.search.Settings.scouting`) and the next-token prior of the search it runs ahead of (:mod:`.scout`)."""
    probe = model.probe
    layer = probe.layer(layer)
    device = probe.device
    policies = list(policies) if policies is not None else [_make_policy(config) for _ in states]
    wants_prior = not config.exhaustive and any(policy.uses_next_tokens for policy in policies)
    settings, reading = _settings(model, layer, config, policies, len(states), ties, wants_prior, calibration)
    settings = replace(settings, scouting=scouting)
    start = time.perf_counter()  # the policies' per-prompt set-up counts; cached tables are built above
    clean = list(clean_states) if clean_states is not None else [None] * len(states)
    searches = [
        PromptSearch(
            s.to(device=device, dtype=torch.float32),
            policy,
            settings,
            torch.Generator().manual_seed(config.seed),
            None if c is None else c.to(device),
        )
        for s, policy, c in zip(states, policies, clean, strict=True)
    ]
    prior, prior_share = given_prior, 0.0
    if wants_prior and prior is None:
        start_prior = time.perf_counter()
        fused = max(policy.fused for policy in policies) if reading is not None else 0.0
        if fused > 0 and all(policy.fit_fused for policy in policies):  # the weight fitted for this layer's reading
            fused = fitted_weight(model, layer, reading, fused)
        prior = NextTokenPrior(model, layer, [search.targets for search in searches], reading=reading, fused=fused)
        prior_share = (time.perf_counter() - start_prior) / len(searches)  # ranking, counted at position 0
    if prior is not None and config.speculate and chains_reproduce(probe):
        for i, search in enumerate(searches):
            search.speculator = Speculator(prior.firsts(i), settings.scale)
        if _scouts(model, layer, config, wants_prior) and not config.known:
            _seed(probe, layer, searches, _scout(model, layer, states, config, copy.copy(prior)))
    for i, search in enumerate(searches):
        search.policy.begin_prompt(search.targets, None if prior is None else prior.readings(i))
        search.fitted = bool(config.known)  # sure positions: the states fit this model (the acceptor's budget)
        for t, token in enumerate(config.known):
            search.positions.append(PositionResult(token, math.nan, math.inf, math.nan, 0, True, reason=KNOWN))
            search.policy.accepted(t, token)
            if search.speculator is not None:
                search.speculator.decided(t, token)
    _run(probe, layer, searches, prior, prior_share, on_position, config.known)
    overhead = (time.perf_counter() - start - sum(search.elapsed for search in searches)) / len(searches)
    return [_result(model, layer, config, policies[0].name, search, overhead) for search in searches]


def _settings(
    model: LoadedModel,
    layer: Layer,
    config: InvertConfig,
    policies: list[Policy],
    count: int,
    ties: dict[int, tuple[int, ...]] | None,
    wants_prior: bool,
    calibration: Calibration | None = None,
) -> tuple[Settings, Reading | None]:
    """The searches' shared settings (tables, radii, budget, error model; built or read once per model and layer),
    the reading network where one serves (``wants_prior``: a policy ranks by the next-token prior), and each policy
    prepared for the model and layer. ``calibration``: radii to use instead of the measured ones (the scout's)."""
    probe = model.probe
    exhaustive = config.exhaustive
    vocab = probe.vocab_size
    table = None
    if config.first_table and policies[0].uses_first_table and not exhaustive:
        table = first_table_for(model, layer, progress=config.progress)
    given = calibration is not None
    if calibration is None:  # measured once, cached like the tables
        calibration = calibrate(model, layer).scaled(config.tolerance_scale)
    if not given and not exhaustive and (probe.can_screen if config.screen is None else config.screen):
        calibration = replace(calibration, screen=screen_calibration(model, layer))
    reading = None
    if wants_prior and any(p.uses_reading for p in policies):  # the reading network where one was trained
        reading = reading_for(model, layer)
    settings = Settings(
        calibration=calibration,
        budget=vocab if config.max_candidates is None or config.certify else max(1, min(vocab, config.max_candidates)),
        vocab=vocab,
        exhaustive=exhaustive,
        source=bound_source(model, layer, config.source),
        table=table,
        ties=ties or {},
        scale=config.batch_scale or batch_scale(probe.device, count),
        deadline=config.deadline,
        guess_ends=config.guess_ends,
    )
    for policy in policies:  # what a policy keeps per model and layer (the position-1 map's norms), like the tables
        policy.prepare(model, layer, first_table=table is not None, reading=reading)
    return settings, reading


def _run(
    probe: LayerProbe,
    layer: Layer,
    searches: list[PromptSearch],
    prior: NextTokenPrior | None,
    prior_share: float,
    on_position: OnPosition | None,
    known: Sequence[int] = (),
) -> None:
    """Every prompt's positions in lockstep from the first after ``known``: rank, verify and decide position t of the
    prompts still searching, grow their prefixes by the decided tokens, drop the prompts that are done."""
    live = list(range(len(searches)))  # prompts still being inverted = the rows of `prefix`
    prefix, source = probe.prefixes([list(known)] * len(live), layer), searches[0].settings.source
    t = len(known)
    while live:
        group = [searches[i] for i in live]
        shared = time.perf_counter()
        orders = prior.orders(t) if prior is not None else None
        shared = (time.perf_counter() - shared) / len(group)
        for row, search in enumerate(group):
            search.begin(t, probe, prefix, row, None if orders is None else orders[row])
            search.clock.add("ranking", shared + (prior_share if t == 0 else 0.0))
        with _math(probe, group[0].settings, t), shaped(probe, [s.targets for s in group], t, source):
            search_position(probe, prefix, layer, group)
        tokens = [search.decide() for search in group]
        keep = [row for row, search in enumerate(group) if search.length > t + 1 and not search.halted]
        if keep:
            shared = time.perf_counter()
            prefix = probe.select(prefix, keep)
            with _math(probe, group[0].settings, t + 1), shaped(probe, [group[r].targets for r in keep], t, source):
                prefix, forward = _advance(probe, prefix, [tokens[row] for row in keep], [group[row] for row in keep])
            shared = (time.perf_counter() - shared) / len(keep)
            for row in keep:
                group[row].clock.add("extension", shared)
                group[row].clock.forwards += forward
            if prior is not None:
                prior.select(keep)
        for i, search in zip(live, group, strict=True):
            result = search.finish()
            if on_position is not None:
                on_position(i, t, result)
        live = [live[row] for row in keep]
        t += 1


def _scouts(model: LoadedModel, layer: Layer, config: InvertConfig, wants_prior: bool) -> bool:
    """Whether the scout goes first (:mod:`.scout`): ``config.scout`` where given, else where it pays and no budget
    of candidates per position was set (the scout's candidates come on top of it); for a policy-guided search that
    speculates, on a model whose linear layers can run in bfloat16."""
    if config.scout is False or config.exhaustive or not config.speculate or not wants_prior:
        return False
    pays = config.max_candidates is None and scout.pays(model, layer)
    return model.probe.screen_refusal is None and (bool(config.scout) or pays)


def _scout(
    model: LoadedModel, layer: Layer, states: Sequence[torch.Tensor], config: InvertConfig, prior: NextTokenPrior
) -> list[InversionResult]:
    """Each prompt's guess (its tokens from position 0 up to the first position the scout gave up, that one included):
    the search run ahead with bfloat16 GEMMs (:mod:`.scout`), at most ``scout.BUDGET`` candidates per position, ranked
    by ``prior`` (a copy of the search's own)."""
    budget = min(scout.BUDGET, config.max_candidates or scout.BUDGET)
    ahead = replace(config, scout=False, screen=False, progress=False, max_candidates=budget)
    calibration = scout.scouting_calibration(model, layer, config.tolerance_scale)
    return invert_prompts(model, states, layer, ahead, calibration=calibration, scouting=True, given_prior=prior)


def _math(probe: LayerProbe, settings: Settings, t: int) -> contextlib.AbstractContextManager:
    """How the forwards for position ``t`` compute: with bfloat16 GEMMs in the scout's search from position 1 on (its
    position 0 in float32: the first tokens' states lie closer together than a bfloat16 state's error there), else as
    the probe does (:mod:`.scout`)."""
    return probe.screening() if settings.scouting and t > 0 else contextlib.nullcontext()


def _seed(probe: LayerProbe, layer: Layer, searches: list[PromptSearch], guesses: list[InversionResult]) -> None:
    """Each prompt's guess (the scout's) through one plain forward shaped like the observer's (its tokens filled to the
    observed length with the last), its states given to the positions they guess
    (:meth:`.speculation.Speculator.seed`); the scout's candidates, forwards and margins are kept for their
    positions."""
    for search, guess in zip(searches, guesses, strict=True):
        search.scouted = [(p.candidates_checked, p.forwards, p.token_id, p.margin) for p in guess.positions]
        tokens = list(guess.token_ids[: search.length])
        if search.speculator is None or not tokens:
            continue
        rows = probe.plain_states([tokens + tokens[-1:] * (search.length - len(tokens))], layer)
        search.speculator.seed(tokens, rows.states[0, : len(tokens)].float())
        candidates, forwards, token, margin = search.scouted[0]
        search.scouted[0] = (candidates, forwards + 1, token, margin)


def _result(
    model: LoadedModel, layer: Layer, config: InvertConfig, policy: str, search: PromptSearch, overhead: float
) -> InversionResult:
    """A finished search as a result (``overhead``: its share of the time no search counted)."""
    return InversionResult(
        token_ids=[p.token_id for p in search.positions],
        text=model.decode([p.token_id for p in search.positions]),
        seconds=search.elapsed + overhead,
        positions=search.positions,
        layer=layer.name,
        model=model.name,
        method=config.method,
        policy=policy,
        vocab_size=model.probe.vocab_size,
        dtype=model.dtype,
        device=str(model.probe.device),
        source=config.source.label,
        notes=misfit_notes(search, config.source),
    )


def _advance(probe: LayerProbe, prefix: Prefix, tokens: list[int], searches: list[PromptSearch]) -> tuple[Prefix, bool]:
    """The prefix grown by each row's decided token: from the keys and values its verification computed when every
    row has them (no forward); deferred when every row may decide its next position from a plain forward's state
    without reading the cache (:meth:`LayerProbe.defer`: the keys are computed with the next forward that needs them,
    several deferred tokens in one); else by one forward (a token decided outside the ball; layer 0); and
    whether a forward ran. At position 0 too: the first verification forward, over an empty prefix, keeps its keys."""
    kept = [search.keys.get(token) for search, token in zip(searches, tokens, strict=True)]
    if not prefix.behind and all(k is not None for k in kept):
        return probe.advance_from(prefix, tokens, NewKeys.stack([k for k in kept if k is not None])), False
    if (prefix.cache is not None or prefix.layer.top_block > 0) and all(s.may_skip_cache for s in searches):
        return probe.defer(prefix, tokens), False
    return probe.advance_rows(prefix, tokens)[0], True
