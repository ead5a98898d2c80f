"""The sequential inversion engine (SIPIT): recover token ids position by position.

For t = 0..T-1, with the recovered prefix's KV cache fixed (blocks 1..l only, computed once and extended by
one token per position), a policy proposes candidate batches; each batch is verified by one batched
one-position forward; the first candidate inside the acceptance ball is taken. If none passes within the
budget, the closest verified candidate is kept and the position is marked uncertain.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ..models import LayerSpec, LoadedModel
from .context import PositionContext
from .policies import POLICIES, Policy, SweepPolicy, TablePolicy
from .results import InversionResult, PositionResult
from .tables import first_position_table
from .tolerance import noise_tolerance, tolerance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InvertConfig:
    """How to invert. ``method``: ``sipit`` (policy-guided, stops at the first accepted candidate) or
    ``bruteforce`` (verifies the whole vocabulary at every position and takes the arg-min: the oracle)."""

    method: str = "sipit"
    policy: str = "linear"
    first_table: bool = True  # rank position 0 with the first-position table (policies that support it)
    max_candidates: int | None = None  # per position; default: the whole vocabulary
    tolerance_scale: float = 1.0
    noise: float = 0.0  # relative Gaussian noise level the states carry (widens the acceptance tolerance)
    seed: int = 0
    progress: bool = False


def _make_policy(config: InvertConfig) -> Policy:
    if config.method == "bruteforce":
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
    probe = model.probe
    layer = probe.layer(layer)
    policy = policy or _make_policy(config)
    exhaustive = config.method == "bruteforce"
    vocab = probe.vocab_size
    budget = vocab if config.max_candidates is None else max(1, min(vocab, config.max_candidates))
    generator = torch.Generator().manual_seed(config.seed)
    table = None
    if config.first_table and policy.uses_first_table and not exhaustive:
        table = first_position_table(model, layer, progress=config.progress)
    start = time.perf_counter()  # the policy's per-prompt set-up counts; cached tables are built above
    targets = states.to(torch.float32)
    policy.prepare(model, layer, first_table=table is not None)
    policy.begin_prompt(targets)
    prefix = probe.prefix([], layer)
    results: list[PositionResult] = []
    for t in range(targets.shape[0]):
        target = targets[t]
        accept = tolerance(target, probe.dtype, config.tolerance_scale) + noise_tolerance(target, config.noise)
        ctx = PositionContext(probe, prefix, target, accept, t, generator)
        active = TablePolicy(table) if (t == 0 and table is not None) else policy
        clock = _Clock()
        while ctx.checked < budget:
            with clock("ranking"):
                ids = active.propose(ctx)
            if ids is None or ids.numel() == 0:
                break
            ids = ids[~ctx.seen[ids]][: budget - ctx.checked]
            if ids.numel() == 0:
                break
            with clock("verification"), torch.no_grad():
                cand = probe.continuation(prefix, token_ids=ids).float()
                dists = (cand.double() - target.double()).norm(dim=1)
                ctx.record(ids, cand, dists)
            if ctx.accepted and not exhaustive:
                break
        with clock("ranking"):
            if active is policy:
                policy.end_position(ctx)
            policy.accepted(t, ctx.best_id)
        decided = _decide(ctx, budget, vocab, clean_states[t] if clean_states is not None else None)
        if ties and decided.token_id in ties:  # no state can tell these tokens apart: say so
            decided = replace(decided, uncertain=True, tied_with=ties[decided.token_id])
        with clock("extension"):
            prefix = probe.extend(prefix, ctx.best_id)
        decided = replace(decided, **clock.seconds)
        results.append(decided)
        if on_position is not None:
            on_position(t, results[-1])
    seconds = time.perf_counter() - start
    ids = [r.token_id for r in results]
    return InversionResult(
        token_ids=ids,
        text=model.decode(ids),
        seconds=seconds,
        positions=results,
        layer=layer.name,
        model=model.name,
        method=config.method,
        policy="sweep" if exhaustive else policy.name,
        vocab_size=vocab,
    )


class _Clock:
    """Seconds spent per kind of work at one position (ranking, verification, prefix extension)."""

    def __init__(self) -> None:
        self.seconds = {"ranking_seconds": 0.0, "verification_seconds": 0.0, "extension_seconds": 0.0}

    @contextlib.contextmanager
    def __call__(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"{kind}_seconds"] += time.perf_counter() - start


def _decide(ctx: PositionContext, budget: int, vocab: int, clean: torch.Tensor | None) -> PositionResult:
    """Summarise a position: accepted id, distance, margin, uncertainty, certified radius."""
    ids, dists = ctx.all_ids(), ctx.all_dists()
    others = dists[ids != ctx.best_id]
    margin = float(others.min()) if others.numel() else float("inf")
    inside = int((dists <= ctx.tolerance).sum())
    uncertain = not ctx.accepted or inside > 1
    noise_norm = certified = None
    if clean is not None and ctx.best_state is not None:
        noise_norm = float((ctx.target.double() - clean.double()).norm())
        states = ctx.all_states()
        gaps = (states[ids != ctx.best_id].double() - ctx.best_state.double()).norm(dim=1)
        certified = float(gaps.min()) / 2 if gaps.numel() else float("inf")
    return PositionResult(
        token_id=ctx.best_id,
        distance=ctx.best_dist,
        margin=margin,
        tolerance=ctx.tolerance,
        candidates_checked=ctx.checked,
        uncertain=uncertain,
        noise_norm=noise_norm,
        certified_radius=certified,
        certified_exact=ctx.checked >= vocab,
    )


def progress_callback(total: int, desc: str, enabled: bool) -> tuple[Callable[[int, PositionResult], None], tqdm]:
    bar = tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False)

    def update(t: int, result: PositionResult) -> None:
        bar.update(1)
        bar.set_postfix(checked=result.candidates_checked, refresh=False)

    return update, bar
