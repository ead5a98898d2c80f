"""A reference SIPIT (the paper's Algorithm 1), simple on purpose: the oracle the fast engine is tested against.

For each position t, with the recovered prefix fixed, one order over the whole vocabulary (a seeded random permutation
by default) is verified batch by batch, each batch by ONE plain uncached forward of the full sequences prefix +
candidate (:meth:`lminvert.models.LayerProbe.states`), comparing the layer's state at the last position with the
observed one (float32 states, float64 distances; float32 on MPS). No KV cache, no policies, no speculation, no
screening: what the fast engine (:mod:`.engine`, :mod:`.search`) adds for speed must not change its answers, and this
module gives the answers it is compared with.

Every decision is :func:`.acceptor.decide`'s, with the radii of :meth:`.search.PromptSearch.begin` for a search that
is plain throughout: every state here comes from a plain forward, so the cached radius is the plain one and every
verified candidate's plain distance is known. A position ends at the acceptor's first final decision, or when the
vocabulary is spent (final by construction); its verdict is :func:`.acceptor.final_verdict`'s, ``uncertain`` from the
first guess on. Unlike the engine, it never gives up early on a source that cannot be reproduced (its order does
not put the true token first: :attr:`.acceptor.Evidence.bounded` is False); ``order="nearest-embedding"`` verifies
candidates by the cosine of their input vector with the observation first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import Layer, LayerSpec, LoadedModel
from . import acceptor
from .acceptor import Evidence, Radii
from .context import wide_dtype
from .engine import bound_source
from .sources import ErrorModel, Exact
from .tolerance import FLOOR, Calibration, calibrate, norm

ORDERS = ("random", "nearest-embedding")


@dataclass(frozen=True)
class ReferenceResult:
    token_ids: list[int]
    verdicts: list[str]
    candidates_checked: list[int]  # candidates verified per position


def reference_invert(
    model: LoadedModel,
    states: torch.Tensor,
    layer: LayerSpec,
    source: ErrorModel | None = None,
    batch: int = 256,
    order: str = "random",
    seed: int = 0,
) -> ReferenceResult:
    """Recover the token ids whose layer-``layer`` states are ``states`` ``[T, d]`` (see the module docstring).

    ``source``: the error model of the states (default :class:`.sources.Exact`; one computed elsewhere gets this
    model's measured foreign disagreements, as :func:`lminvert.invert` gives it). ``order``: ``"random"`` (a
    permutation seeded by ``seed`` and the position) or ``"nearest-embedding"``.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown order '{order}': use one of {', '.join(ORDERS)}")
    if batch < 1:
        raise ValueError("batch must be at least 1")
    probe = model.probe
    layer = probe.layer(layer)
    source = source or Exact()
    source = bound_source(model, layer, source)
    calibration = calibrate(model, layer)
    token_ids: list[int] = []
    verdicts: list[str] = []
    checked: list[int] = []
    after_guess = False
    for t in range(states.shape[0]):
        target = states[t].to(device=probe.device, dtype=torch.float32)
        candidates = _order(model, target, order, seed * 1_000_003 + t)
        radii = _radii(calibration, source, t, target)
        decision, count = _position(model, layer, token_ids, target, candidates, radii, source.reproducible, batch)
        verdicts.append(acceptor.final_verdict(decision, tied=False, after_guess=after_guess))
        after_guess = after_guess or decision.guess
        assert decision.token is not None
        token_ids.append(decision.token)
        checked.append(count)
    return ReferenceResult(token_ids=token_ids, verdicts=verdicts, candidates_checked=checked)


def _radii(calibration: Calibration, source: ErrorModel, t: int, target: torch.Tensor) -> Radii:
    """:meth:`.search.PromptSearch.begin`'s radii where every state comes from a plain forward."""
    bound = source.bound(target, t)
    rounding = calibration.confirm_radius(target)
    return Radii(
        cached=rounding + bound,
        plain=rounding + bound,
        source=bound,
        rounding=rounding,
        gap=calibration.gap * norm(target),
        resolution=FLOOR * norm(target),
        fragile=source.fragile(target, t),
    )


def _order(model: LoadedModel, target: torch.Tensor, order: str, seed: int) -> torch.Tensor:
    """Every vocabulary id once, in the order they are verified."""
    probe = model.probe
    if order == "random":
        return torch.randperm(probe.vocab_size, generator=torch.Generator().manual_seed(seed)).to(probe.device)
    vocab = probe.vocab_matrix(torch.float32)
    cosine = torch.nn.functional.cosine_similarity(vocab, target[None], dim=1)
    return cosine.argsort(descending=True, stable=True)


def _position(
    model: LoadedModel,
    layer: Layer,
    prefix: list[int],
    target: torch.Tensor,
    candidates: torch.Tensor,
    radii: Radii,
    reproducible: bool,
    batch: int,
) -> tuple[acceptor.Decision, int]:
    """The acceptor's final decision at one position, and how many candidates were verified for it."""
    vocab = len(candidates)
    states = torch.empty(vocab, target.numel(), dtype=torch.float32, device=target.device)
    wide = wide_dtype(target.device)
    dists = torch.empty(vocab, dtype=wide, device=target.device)
    plain: dict[int, float] = {}  # every verified state is a plain forward's: its distance is a plain distance
    done = 0
    while True:
        ids = candidates[done : done + batch]
        seqs = torch.tensor([[*prefix, i] for i in ids.tolist()])
        found = model.probe.states(seqs, [layer])[layer][:, -1].float()
        new = slice(done, done + len(ids))
        states[new] = found
        dists[new] = (found.to(wide) - target.to(wide)).norm(dim=1)
        plain.update(zip(ids.tolist(), dists[new].tolist(), strict=True))
        done += len(ids)
        evidence = Evidence(
            ids=candidates[:done],
            dists=dists[:done],
            states=states[:done],
            target=target,
            plain=plain,
            reach=radii.cached,
            reproducible=reproducible,
            exhausted=done == vocab,
            swept=done == vocab,
            checked=done,
            ranked=True,
            bounded=False,
        )
        decision = acceptor.decide(evidence, radii)  # contenders to confirm are measured already: pending as well
        if decision.final:
            return decision, done
        if done == vocab:  # not reached: with every distance known, a spent vocabulary is decided
            nearest = int(candidates[dists.argmin()])
            return acceptor.Decision(nearest, acceptor.UNCERTAIN, guess=True, reason="vocabulary spent"), done
