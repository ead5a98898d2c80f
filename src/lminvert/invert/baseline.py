"""The sequential baseline: SIPIT the way the paper's released code runs it, to compare lminvert against.

Public (``lminvert.invert.baseline.sequential_baseline``) so that any speed-up lminvert reports can be
measured again against it, on the same machine, in the same process (``benchmarks/bench_invert.py`` does).

One candidate at a time: a gradient step on a continuous input vector at position t, then the nearest
not-yet-tried vocabulary entry is checked by a full forward of prefix + candidate through the whole model
(no KV cache, no early stop, all hidden states returned). Exact but slow; lminvert's engine must beat it.
Each position is decided by the engine's acceptor (:mod:`.acceptor`) from the candidates checked so far, with the
engine's measured radius for a plain forward (:mod:`.tolerance`), so both solve the same problem and give their tokens
the same verdicts; a position whose budget runs out without a decision keeps its nearest candidate, ``uncertain``.
Everything runs on the model's device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models import Layer, LayerSpec, LoadedModel
from . import acceptor
from .acceptor import Evidence, Radii
from .sources import ErrorModel, Exact
from .tolerance import FLOOR, calibrate, norm


@dataclass(frozen=True)
class BaselineResult:
    token_ids: list[int]
    seconds: float
    candidates_checked: list[int]
    complete: bool  # False when the time limit stopped it
    verdicts: tuple[str, ...] = ()  # per recovered position (:mod:`.acceptor`)


def _layer_state(model: LoadedModel, embeds: torch.Tensor, layer: Layer) -> torch.Tensor:
    """State of the last position at ``layer`` from a full, uncached forward of the whole model (LM head
    included, as the reference code does); the layer is read with a hook so its semantics match the probe."""
    return model.probe.embeds_states(embeds, [layer], whole=True)[layer][0, -1]


def _step(
    model: LoadedModel,
    layer: Layer,
    x: torch.Tensor,
    opt: torch.optim.Optimizer,
    prefix: torch.Tensor | None,
    target: torch.Tensor,
    vocab: torch.Tensor,
    tried: torch.Tensor,
) -> int:
    """One gradient step on the input vector ``x`` (a full forward and backward through the whole model), then the
    nearest vocabulary entry not tried yet (marked tried)."""
    opt.zero_grad()
    seq = x[None] if prefix is None else torch.cat([prefix, x[None]])
    loss = (_layer_state(model, seq.to(model.probe.dtype), layer).float() - target).square().sum()
    (loss / target.square().sum()).backward()
    opt.step()
    with torch.no_grad():
        dist = (vocab - x.detach()).norm(dim=1)
        dist[tried] = float("inf")
        cand = int(dist.argmin())
    tried[cand] = True
    return cand


class _Position:
    """The candidates one position checked (one plain forward each), for the acceptor."""

    def __init__(self, target: torch.Tensor, radii: Radii, source: ErrorModel, vocab: int) -> None:
        self.target, self.radii, self.source, self.vocab = target, radii, source, vocab
        self.ids: list[int] = []
        self.states: list[torch.Tensor] = []
        self.dists: list[float] = []

    def add(self, token: int, state: torch.Tensor) -> acceptor.Decision:
        """Record ``token``'s state and ask the acceptor (every state here is a plain forward's)."""
        self.ids.append(token)
        self.states.append(state.detach().double())
        self.dists.append(float((state.double() - self.target.double()).norm()))
        exhausted = len(self.ids) >= self.vocab
        evidence = Evidence(
            ids=torch.tensor(self.ids),
            dists=torch.tensor(self.dists, dtype=torch.float64),
            states=lambda: torch.stack(self.states),
            target=self.target,
            plain=dict(zip(self.ids, self.dists, strict=True)),
            reach=self.radii.cached,
            reproducible=self.source.reproducible,
            exhausted=exhausted,
            swept=exhausted,
            confirmed=True,
            checked=len(self.ids),
        )
        return acceptor.decide(evidence, self.radii)


def sequential_baseline(
    model: LoadedModel,
    states: torch.Tensor,
    layer: LayerSpec,
    lr: float = 0.1,
    time_limit: float | None = None,
    known: list[int] | None = None,
    source: ErrorModel | None = None,
) -> BaselineResult:
    """Invert ``states`` [T, d] one candidate per gradient step, with full uncached forwards.

    ``known`` gives the first tokens (their states are skipped), e.g. to time ordinary positions without the
    first position's attention sink. ``source``: the states' error model (default: lminvert's own states).
    """
    probe = model.probe
    layer = probe.layer(layer)
    device = probe.device
    calibration = calibrate(model, layer)
    source = source or Exact()
    vocab = probe.vocab_matrix(torch.float32)
    embed = probe.embed
    recovered: list[int] = list(known or [])
    checked: list[int] = []
    verdicts: list[str] = []
    guessed = False
    start = time.perf_counter()

    def result(complete: bool) -> BaselineResult:
        ids = recovered[len(known or []) :]
        return BaselineResult(ids, time.perf_counter() - start, checked, complete, tuple(verdicts))

    for t in range(len(recovered), states.shape[0]):
        target = states[t].to(device=device, dtype=torch.float32)
        plain = calibration.confirm_radius(target) + source.bound(target, t)
        size = norm(target)
        bound, fragile = source.bound(target, t), source.fragile(target, t)
        radii = Radii(plain, plain, bound, plain, calibration.gap * size, FLOOR * size, fragile)
        position = _Position(target, radii, source, len(vocab))
        prefix = embed(torch.tensor(recovered, dtype=torch.long, device=device)).detach() if recovered else None
        x = vocab.mean(0).clone().requires_grad_(True)
        opt = torch.optim.SGD([x], lr=lr)
        tried = torch.zeros(len(vocab), dtype=torch.bool, device=device)
        decision = acceptor.PENDING
        while not decision.final:
            if time_limit is not None and time.perf_counter() - start > time_limit:
                return result(False)
            cand = _step(model, layer, x, opt, prefix, target, vocab, tried)
            with torch.no_grad():
                seq = embed(torch.tensor([*recovered, cand], device=device))
                decision = position.add(cand, _layer_state(model, seq, layer).float())
        assert decision.token is not None
        recovered.append(decision.token)
        checked.append(len(position.ids))
        verdicts.append(acceptor.final_verdict(decision, tied=False, after_guess=guessed))
        guessed = guessed or decision.guess
    return result(True)
