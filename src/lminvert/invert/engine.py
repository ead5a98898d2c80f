"""The sequential inversion engine (SIPIT): recover token ids position by position, for many prompts at once.

For t = 0..T-1, with the recovered prefixes' KV caches fixed (blocks 1..l only, computed once and extended by one
token per position), each prompt's policy proposes candidate batches; the batches of every prompt still searching
position t are verified together by **one** batched one-position forward (each candidate row reads its own
prompt's prefix from one batched cache; split only when candidate rows x prefix length would exceed
``POSITIONS``, which bounds the memory of the copied keys and values); each prompt's search (:mod:`.search`)
applies the acceptance test and asks for confirmations, which are computed together by one plain forward.
Prompts advance in lockstep, so all prefixes have the same length and share one cache without padding; a prompt
that finished position t waits (costing nothing) for the others. One prompt is the special case N = 1. If
nothing passes within the budget, the closest verified candidate is kept and the position is marked uncertain.

Screening (``InvertConfig.screen``; by default a float32 model on a CPU with native bfloat16 GEMMs): a later batch of
``SCREEN_FROM`` candidates or more first runs with bfloat16 GEMMs (:meth:`LayerProbe.screening`, 2.5-3x faster
here), and only its candidates near the target are verified (:mod:`.search`); the prefix keeps float32 keys.

Shared work (a verification forward serving several prompts, the prefix extension, the next-token prior: one
forward of the upper blocks before position 0, counted as position 0's ranking) is split evenly among the prompts
it served in each prompt's time split, so the prompts' seconds add up to the wall time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..models import Layer, LayerProbe, LayerSpec, LoadedModel, NewKeys, Prefix
from . import acceptor
from .context import batch_scale
from .policies import POLICIES, Policy, SweepPolicy
from .proposal import NextTokenPrior
from .reader import reading_for
from .results import InversionResult, PositionResult
from .search import PromptSearch, Settings
from .sources import ErrorModel, Exact
from .speculation import Speculator
from .tables import first_position_table, squared_norms
from .tolerance import calibrate, foreign_calibration, screen_calibration

log = logging.getLogger(__name__)

OnPosition = Callable[[int, int, PositionResult], None]  # (prompt index, position, result)
POSITIONS = 1 << 19  # candidate rows x prefix length per verification forward (bounds the copied keys and values)
# positions after the confirmed one whose states a plain forward computes for the next positions' first guesses, where
# it starts from kept keys (:mod:`lminvert.models.observed`; None: to the end). SmolLM2 bfloat16, layer 15, the 7
# benchmark prompts, same run: median 1.63 / 1.38 / 1.25 / 1.36 s for all / 8 / 4 / 2 (forwards 208 / 210 / 212 / 226)
PLAIN_AHEAD: int | None = 4
# candidates of a verification forward from which it is screened: SmolLM2 layer 30, this project's CPU, one forward of
# 16 / 64 / 256 / 512 candidates in float32 50 / 103 / 311 / 592 ms, screened 25 / 43 / 105 / 210 ms
# (benchmarks/bench_screen.py); the few verified in full then cost one small float32 forward (~25-50 ms)
SCREEN_FROM = 64


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
    # wall-clock time (time.time()) after which each position stops after its first batch, keeping the closest
    # candidate (the acceptor then rules, as for any budget: such a position is at best what its evidence shows)
    deadline: float | None = None
    tolerance_scale: float = 1.0  # multiplies the measured acceptance radii
    # where the states come from: how far an observation may lie from this machine's plain forward (:mod:`.sources`)
    source: ErrorModel = field(default_factory=Exact)
    seed: int = 0
    progress: bool = False
    speculate: bool = True  # verify the next positions' first guesses in chains (:mod:`.speculation`; speed only)
    batch_scale: int | None = None  # candidate batches relative to a CPU's; default: by device (context.batch_scale)
    screen: bool | None = None  # screen large batches with bfloat16 GEMMs (speed only); None: where it pays


def _bound_source(model: LoadedModel, layer: Layer, source: ErrorModel) -> ErrorModel:
    """``source`` with this model's measured foreign disagreements where its bound needs them (cached)."""
    if not source.needs_calibration:
        return source
    return source.calibrated(*foreign_calibration(model, layer))


def _make_policy(config: InvertConfig) -> Policy:
    if config.method == "bruteforce" or config.certify:
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
) -> list[InversionResult]:
    """Recover the token ids of N prompts from their layer-``layer`` states ``[T_i, d]``, advanced together."""
    probe = model.probe
    layer = probe.layer(layer)
    device = probe.device
    exhaustive = config.method == "bruteforce" or config.certify
    vocab = probe.vocab_size
    policies = list(policies) if policies is not None else [_make_policy(config) for _ in states]
    table = None
    if config.first_table and policies[0].uses_first_table and not exhaustive:
        table = first_position_table(model, layer, progress=config.progress)
    calibration = calibrate(model, layer).scaled(config.tolerance_scale)  # measured once, cached like the tables
    if not exhaustive and (probe.can_screen if config.screen is None else config.screen):
        calibration = replace(calibration, screen=screen_calibration(model, layer))
    wants_prior = not exhaustive and any(policy.uses_next_tokens for policy in policies)
    reading = None
    if wants_prior and any(p.uses_reading for p in policies):  # the reading network where one was trained
        reading = reading_for(model, layer)
    settings = Settings(
        calibration=calibration,
        budget=vocab if config.max_candidates is None or config.certify else max(1, min(vocab, config.max_candidates)),
        vocab=vocab,
        exhaustive=exhaustive,
        source=_bound_source(model, layer, config.source),
        table=table,
        ties=ties or {},
        scale=config.batch_scale or batch_scale(device, len(states)),
        table_norms=None if table is None else squared_norms(model, f"table-{layer.name}", table),
        deadline=config.deadline,
    )
    for policy in policies:  # what a policy keeps per model and layer (the position-1 map's norms), like the tables
        policy.prepare(model, layer, first_table=table is not None, reading=reading)
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
    prior, prior_share = None, 0.0
    if wants_prior:
        start_prior = time.perf_counter()
        prior = NextTokenPrior(model, layer, [search.targets for search in searches], reading=reading)
        prior_share = (time.perf_counter() - start_prior) / len(searches)  # ranking, counted at position 0
        if config.speculate:
            for i, search in enumerate(searches):
                search.speculator = Speculator(prior.firsts(i), settings.scale)
    for i, search in enumerate(searches):
        search.policy.begin_prompt(search.targets, None if prior is None else prior.readings(i))
    live = list(range(len(searches)))  # prompts still being inverted = the rows of `prefix`
    prefix = probe.prefixes([[]] * len(live), layer)
    t = 0
    while live:
        group = [searches[i] for i in live]
        shared = time.perf_counter()
        orders = prior.orders(t) if prior is not None else None
        shared = (time.perf_counter() - shared) / len(group)
        for row, search in enumerate(group):
            search.begin(t, probe, prefix, row, None if orders is None else orders[row])
            search.clock.add("ranking", shared + (prior_share if t == 0 else 0.0))
        _search_position(probe, prefix, layer, group)
        tokens = [search.decide() for search in group]
        keep = [row for row, search in enumerate(group) if search.length > t + 1]
        if keep:
            shared = time.perf_counter()
            prefix = probe.select(prefix, keep)
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
    wall = time.perf_counter() - start
    overhead = (wall - sum(search.elapsed for search in searches)) / len(searches)
    policy_name = policies[0].name
    return [
        InversionResult(
            token_ids=[p.token_id for p in search.positions],
            text=model.decode([p.token_id for p in search.positions]),
            seconds=search.elapsed + overhead,
            positions=search.positions,
            layer=layer.name,
            model=model.name,
            method=config.method,
            policy=policy_name,
            vocab_size=vocab,
            dtype=model.dtype,
            device=str(device),
            source=config.source.label,
            notes=_notes(search, config.source),
        )
        for search in searches
    ]


def _notes(search: PromptSearch, source: ErrorModel) -> tuple[str, ...]:
    """What the prompt's result says about its states as a whole."""
    misfit = sum(p.reason == acceptor.NO_FIT for p in search.positions)
    notes: tuple[str, ...] = ()
    if search.cut:
        notes += (
            f"the time bound stopped the search at {search.cut} of {len(search.positions)} positions: each kept the "
            "closest candidate of what it had verified",
        )
    if not misfit:
        return notes
    return (
        *notes,
        f"{misfit} of {len(search.positions)} positions: no candidate fits the error model '{source.label}': these "
        "states do not match this model's computation at this layer (another model, layer or dtype, a fine-tuned "
        "copy, or an error larger than the model allows: try --source noise:LEVEL)",
    )


@dataclass(frozen=True)
class Verified:
    """A verification's states ``[B, d]`` (float32) and the keys and values its forwards computed, by first row."""

    states: torch.Tensor
    chunks: tuple[tuple[int, NewKeys | None], ...]

    def keys(self, index: Sequence[int]) -> list[NewKeys | None]:
        """The keys and values of rows ``index`` of the batch, one row each (None where none were computed)."""
        out: list[NewKeys | None] = []
        for i in index:
            start, new = next(chunk for chunk in reversed(self.chunks) if chunk[0] <= i)
            out.append(None if new is None else new.take(torch.tensor([i - start], device=new.layers[0][0].device)))
        return out


def _verify(
    probe: LayerProbe, prefix: Prefix, ids: torch.Tensor, rows: torch.Tensor | None, screen: bool = False
) -> Verified:
    """Verified states (float32) of candidates ``ids`` (on prefix rows ``rows``), in as few forwards as memory allows:
    each forward copies its rows' prefix keys and values, so rows x prefix length stays under ``POSITIONS``.
    ``screen``: screened states (bfloat16 GEMMs), without keys."""
    step = max(1, POSITIONS // (prefix.length + 1))
    states, chunks = [], []
    with torch.no_grad(), probe.screening() if screen else contextlib.nullcontext():
        for i in range(0, len(ids), step):
            part = None if rows is None else rows[i : i + step]
            if screen:
                out, new = probe.continuation(prefix, token_ids=ids[i : i + step], rows=part), None
            else:
                out, new = probe.continuation(prefix, token_ids=ids[i : i + step], rows=part, keys=True)
            states.append(out)
            chunks.append((i, new))
    return Verified(torch.cat(states).float(), tuple(chunks))


def _advance(probe: LayerProbe, prefix: Prefix, tokens: list[int], searches: list[PromptSearch]) -> tuple[Prefix, bool]:
    """The prefix grown by each row's decided token: from the keys and values its verification computed when every
    row has them (no forward); deferred when every row may decide its next position from a plain forward's state
    without reading the cache (:meth:`LayerProbe.defer`: the keys are computed with the next forward that needs them,
    several deferred tokens in one); else by one forward (a token decided outside the ball; layer 0); and
    whether a forward ran. At position 0 too: the first verification forward, over an empty prefix, keeps its keys."""
    kept = [search.keys.get(token) for search, token in zip(searches, tokens, strict=True)]
    if not prefix.behind and all(k is not None for k in kept):
        return probe.advance_from(prefix, tokens, NewKeys.stack([k for k in kept if k is not None])), False
    if prefix.cache is not None and all(search.may_skip_cache for search in searches):
        return probe.defer(prefix, tokens), False
    return probe.advance_rows(prefix, tokens)[0], True


def _catch_up(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch]) -> None:
    """The deferred tokens' keys and values into the cache (one forward, counted as every prompt's prefix extension)
    before a forward reads it."""
    start = time.perf_counter()
    if probe.catch_up(prefix):
        share = (time.perf_counter() - start) / len(group)
        for search in group:
            search.clock.add("extension", share)
            search.clock.forwards += 1


def _given(search: PromptSearch) -> None:
    """Record the states a chain and a confirmation's plain forward computed for the search's position earlier
    (:mod:`.speculation`), if any: the same token's once, its plain state with the chain's keys. The plain state only
    where the position would be confirmed anyway (the ball is not decisive): elsewhere a chain's state decides alone,
    and its keys grow the prefix without the forward a plain state's token needs."""
    if search.speculator is None:
        return
    chained, plain = search.speculator.take()
    if search.decisive:
        plain = None
    same = chained is not None and plain is not None and chained[0] == plain[0]
    with search.clock("verification"):
        if chained is not None and not same:
            token, state, keys = chained
            search.verified(torch.tensor([token], device=state.device), state[None], lambda _: [keys], given=True)
        if plain is not None:
            search.given_plain(plain[0], plain[1], chained[2] if same and chained is not None else None)


def _tail(search: PromptSearch, ids: torch.Tensor, tree: bool) -> list[int] | None:
    """The guesses that should follow the candidates of the search's first batch ``ids`` in a chain (in a ``tree``:
    those :meth:`.Speculator.roots` names), or None."""
    ctx = search.ctx
    if search.speculator is None or ctx is None or ctx.rounds > 0:
        return None
    return search.speculator.tail(ctx.position, search.length, 1 if tree else len(ids), tree)


def _verify_proposals(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], proposals: list) -> None:
    """Verify the proposed batches ``(row, ids)`` of every prompt: one-token continuations in one batched forward,
    first batches with chains after them (:mod:`.speculation`) in another; record them, keep the keys of candidates
    inside the ball."""
    tree = probe.packs_chains(prefix)  # only the candidates a source guessed carry the chain, the others stand alone
    chained = [(row, ids, tail) for row, ids in proposals if (tail := _tail(group[row], ids, tree)) is not None]
    longest = 1 + max((len(tail) for _, _, tail in chained), default=0)
    if sum(len(ids) for _, ids, _ in chained) * (prefix.length + longest) > POSITIONS:  # too many copied keys
        chained = []
    riding = {row for row, _, _ in chained}
    plain = [(row, ids) for row, ids in proposals if row not in riding]
    if plain:
        _verify_batches(probe, prefix, group, plain)
    if chained:
        _verify_chains(probe, prefix, group, chained, tree)


def _verify_batches(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], plain: list) -> None:
    """Verify the one-token batches ``(row, ids)`` of ``plain`` and record them. The batches of ``SCREEN_FROM``
    candidates or more of searches that screen first run together in one forward with bfloat16 GEMMs, and only each
    one's picks (:meth:`PromptSearch.screen_picks`) join the other batches in the float32 forward (decided per
    prompt, so that a prompt's candidates are the same inverted alone or with others)."""
    start = time.perf_counter()
    fast = [(row, ids) for row, ids in plain if group[row].screens and len(ids) >= SCREEN_FROM]
    picks, forwards = {}, 0
    if fast:
        ids = torch.cat([p[1] for p in fast])
        screened = _verify(probe, prefix, ids, _prefix_rows(prefix, fast, ids.device), screen=True)
        forwards += len(screened.chunks)
        for (row, _), part in zip(fast, screened.states.split([len(p[1]) for p in fast]), strict=True):
            picks[row] = (group[row].screen_picks(part), part)
    full = [(row, ids[picks[row][0]] if row in picks else ids) for row, ids in plain]
    full = [(row, ids) for row, ids in full if len(ids)]
    offsets, offset = {}, 0
    for row, mine in full:
        offsets[row] = offset
        offset += len(mine)
    verified = None
    if full:
        ids = torch.cat([p[1] for p in full])
        verified = _verify(probe, prefix, ids, _prefix_rows(prefix, full, ids.device))
        forwards += len(verified.chunks)
    states = verified.states if verified is not None else torch.empty(0, probe.hidden_size)
    share = (time.perf_counter() - start) / len(plain)
    for row, mine in plain:
        search, at = group[row], offsets.get(row, 0)

        def keys_of(inside: list[int], at: int = at) -> list[NewKeys | None]:
            return [] if verified is None else verified.keys([at + i for i in inside])

        with search.clock("verification"):
            if row in picks:
                chosen, part = picks[row]
                search.screened(mine, part, chosen, states[at : at + len(chosen)], keys_of)
            else:
                search.verified(mine, states[at : at + len(mine)], keys_of)
        search.clock.add("verification", share)
        search.clock.forwards += forwards


def _prefix_rows(prefix: Prefix, batches: list, device: torch.device) -> torch.Tensor | None:
    """The prefix row of every candidate of the batches ``(row, ids, ...)``, in order (None for a one-row prefix)."""
    if prefix.size == 1:
        return None
    return torch.cat([torch.full((len(batch[1]),), batch[0], device=device) for batch in batches])


def _verify_chains(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], chained: list, tree: bool) -> None:
    """First batches ``(row, ids, tail)``, every candidate followed by its prompt's ``tail`` (in a ``tree``: only the
    candidates :meth:`.Speculator.roots` names, the others stand alone), in one forward. Rows shorter than the longest
    are padded with their last token, whose states are not read (in a tree they are not computed either)."""
    size = 1 + max(len(tail) for _, _, tail in chained)
    chains, lengths, roots = [], [], []
    for row, ids, tail in chained:
        speculator = group[row].speculator
        assert speculator is not None
        tokens = ids.tolist()
        ctx = group[row].ctx
        assert ctx is not None
        carriers = speculator.roots(ctx.position, tokens) if tree else range(len(tokens))
        roots.append(carriers)
        for i, token in enumerate(tokens):
            chain = [token, *tail] if i in carriers else [token]
            chains.append([*chain, *chain[-1:] * (size - len(chain))])
            lengths.append(len(chain))
    rows = _prefix_rows(prefix, [(row, ids) for row, ids, _ in chained], probe.device)
    start = time.perf_counter()
    states, new = probe.chains(
        prefix, torch.tensor(chains, device=probe.device), rows, lengths=lengths if tree else None
    )
    states = states.float()
    share = (time.perf_counter() - start) / len(chained)
    offset = 0
    for (row, ids, tail), carriers in zip(chained, roots, strict=True):
        search = group[row]
        assert search.speculator is not None
        mine = range(offset, offset + len(ids))
        keys = [None] * len(ids) if new is None else [new.take(torch.tensor([i], device=probe.device)) for i in mine]
        firsts = [None if k is None else k.at(0) for k in keys]
        per = [[None if keys[i] is None else keys[i].at(j) for j in range(1, 1 + len(tail))] for i in carriers]
        batch = states[offset : offset + len(ids)]
        with search.clock("verification"):
            search.verified(ids, batch[:, 0], lambda inside, firsts=firsts: [firsts[i] for i in inside])
            search.speculator.store(
                [int(ids[i]) for i in carriers], tail, batch[list(carriers), 1 : 1 + len(tail)], per
            )
        search.clock.add("verification", share)
        search.clock.forwards += 1
        offset += len(ids)


def _search_position(probe: LayerProbe, prefix: Prefix, layer: Layer, group: list[PromptSearch]) -> None:
    """Verify and confirm candidates of every prompt in ``group`` at the current position until all are decided."""
    for search in group:
        _given(search)
    pending = list(range(len(group)))  # rows still searching
    while pending:
        proposals = []
        for row in pending:
            search = group[row]
            if not search.to_confirm and not search.done:
                ids = search.propose()
                if ids is not None:
                    proposals.append((row, ids))
        if proposals:
            _catch_up(probe, prefix, group)
            _verify_proposals(probe, prefix, group, proposals)
        for row in [row for row in pending if group[row].to_confirm]:  # plain forwards, shaped like each observation
            search = group[row]
            search.clock.forwards += 1  # one plain forward, however many contenders it holds
            with search.clock("verification"):
                search.confirm(list(search.to_confirm), _plain_states(probe, layer, prefix, row, search))
        pending = [row for row in pending if not group[row].done]


def _plain_states(probe: LayerProbe, layer: Layer, prefix: Prefix, row: int, search: PromptSearch) -> torch.Tensor:
    """States ``[k, d]`` (float32) at the current position of prefix row ``row`` + each contender ``search`` asks
    to confirm, by one plain forward shaped like the observer's: each sequence the whole observed length, the
    positions after this one filled with the candidate (the model is causal: they cannot change this position's state,
    but the kernels' shapes then equal the observer's). On the same device, dtype and threads this reproduces the
    observed state bit for bit; measured on the CPU: an unpadded forward disagrees by up to 4e-2 of the norm in
    bfloat16. The first confirmation of a position holds one sequence, as the observer's forward did; later ones up to
    ``acceptor.MAX_CONFIRM`` (SmolLM2, layer 15, this project's CPU, 2 threads: each row of forwards of 2, 8 and 33 such
    sequences equalled the one-sequence forward bit for bit in float32, bfloat16 and float16; where a device rounds a
    batch differently, the row stays within the plain radius, calibrated on two-row forwards, and the position is
    decided by separation or flagged). With a speculator, the fill is the next positions' first guesses instead,
    whose states it keeps (:mod:`.speculation`). Where the probe can (:mod:`lminvert.models.observed`: a CPU in half
    precision), the forward starts from the keys and values the last confirmation kept for the prefix and computes
    the contender's position and ``PLAIN_AHEAD`` after it only, with the same bits."""
    t = prefix.length
    speculator = search.speculator
    fill = speculator.fill(t, search.length) if speculator is not None else []
    seqs = [[*prefix.rows[row], c, *(fill or [c] * (search.length - t - 1))] for c in search.to_confirm]
    stop = None if PLAIN_AHEAD is None else t + 1 + PLAIN_AHEAD
    rows = probe.plain_states(seqs, layer, upto=t, kept=search.plain_keys, stop=stop)
    states = rows.states.float()[:, t - rows.start :]
    if fill and speculator is not None:
        for c, row_states in zip(search.to_confirm, states, strict=True):
            speculator.store_plain(c, fill[: len(row_states) - 1], row_states[1:])
    search.plain_keys = rows.keys_of(0)  # the first contender's (closest in angle) start the next confirmation
    return states[:, 0]
