"""The model's own next-token ranking at every position, read from the observed states: a free proposal model.

The idea of "Hidden No More" is to rank candidates with a language model. Here the inverted model is that language
model, and it needs no recovered prefix: the observed layer-``l`` states *are* what the model computed at layer
``l`` for the secret prompt, so running the blocks above ``l`` on them (one forward per batch of prompts, before
the search starts: :meth:`LayerProbe.final_from`) gives the model's own next-token distribution at every
position. At the last block or the final norm no block runs at all. Noise or half precision in the observed states
only perturbs the order.

Beside it, what each position's own state reads as (:mod:`.reading`: a linear map or a network) is a second order,
and the two combined are a third (``fused``): the prior's log-probabilities plus ``fused`` times the reading's (the
log-softmax of its scores ``2 p.e_v - ||e_v||^2``, what a reading network is trained on), as a product of experts
ranks. On SmolLM2, 24 held-out prompts of 20 tokens (``benchmarks/bench_first_guess.py``; docs/results.md), the true
token first / within the first 8 at layer 30 with the preparation's network: 26% / 54% by the prior, 31% / 54% by
the reading, 47% / 75% fused with weight 1 (the prior and the reading merged place by place: 26% / 65%); at layer 15
with the linear map 47% / 74% fused against 26% / 69% merged. On random token ids the prior is wrong and sure, and
the product follows it: the policy weighs the fused order by the prior's record too (:mod:`.linear`).

The ranking only orders candidates: every candidate is still verified, so a poor prior (random token ids) costs
time, never exactness. Logits are ranked in float32 whatever the model's precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

from ..models import Layer, LoadedModel
from .reading import Reading, input_distances, read

TOKENS = 8192  # positions x prompts per forward of the upper blocks (bounds its activations)


def ranked(scores: torch.Tensor, descending: bool = False, top: int | None = None) -> torch.Tensor:
    """Every index of ``scores`` ``[k]``, the lowest first (``descending``: the highest), ties in no promised order:
    an order to try candidates in; ``top``: its first ``top`` only (a partial sort). On the CPU by numpy's sort (about
    0.6 ms for SmolLM2's 49,152 scores on this project's CPU, against 3.3-3.7 ms for torch's), elsewhere by torch's."""
    if top is not None and top < scores.shape[-1]:
        return scores.topk(top, dim=-1, largest=descending).indices
    if scores.device.type != "cpu" or scores.dim() != 1:
        return scores.argsort(dim=-1, descending=descending)
    values = scores.detach().float().numpy()
    return torch.from_numpy(numpy.argsort(-values if descending else values))


def merge(sources: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """One order ``[k]`` from several ``[S, k]`` (most likely first): source ``s``'s ``i``-th id at place
    ``(i + 1/2) / weights[s]`` (equal weights: alternately, the first source first), each id kept at its first place
    only, cut to ``k``. A source of weight 0.25 gives one id for every four of a source of weight 1. Equal weights by
    default, without a sort (the same order as ``weights`` all 1)."""
    count, k = sources.shape
    if count == 1:
        return sources[0]
    if weights is None:  # alternately: place by place (the first source first), each id kept where first seen
        merged = sources.T.reshape(-1)
        places = torch.arange(len(merged), device=merged.device)
        first = torch.full((int(merged.max()) + 1,), len(merged), dtype=torch.long, device=merged.device)
        first.scatter_reduce_(0, merged, places, reduce="amin")
        return merged[first[merged] == places][:k]
    w = torch.tensor([float(x) for x in weights])
    keys = (torch.arange(k, dtype=torch.float64)[None] + 0.5) / w.double().clamp_min(1e-3)[:, None]
    merged = sources.reshape(-1)[keys.reshape(-1).argsort(stable=True).to(sources.device)]
    order = merged.argsort(stable=True)  # equal ids: the earliest place first
    ranked = merged[order]
    repeated = torch.zeros_like(ranked, dtype=torch.bool)
    repeated[1:] = ranked[1:] == ranked[:-1]
    later = torch.zeros_like(repeated).scatter(0, order, repeated)  # back to merged places
    return merged[~later][:k]


def reading_log_probs(distances: torch.Tensor) -> torch.Tensor:
    """The reading's log-probabilities ``[N, |V|]``: the log-softmax of minus its ``distances``
    (:func:`.reading.input_distances`, ``||e_v - p||^2 - ||p||^2``: its scores ``2 p.e_v - ||e_v||^2``)."""
    return (-distances).log_softmax(-1)


def fuse(prior: torch.Tensor, reading: torch.Tensor, weight: float) -> torch.Tensor:
    """The fused source's scores ``[N, |V|]`` (highest first): the prior's log-probabilities ``prior`` plus ``weight``
    times the reading's (:func:`reading_log_probs`)."""
    return prior + weight * reading.to(prior.device)


class NextTokenPrior:
    """Next-token orders ``[depth]`` at every position of N prompts (position ``t``: what the model predicts after
    the states of positions ``0..t-1``), computed once from their observed states; with ``reading``, each position's
    reading order beside it (what its own state reads as), and with ``fused`` above 0 the two fused (see the module
    docstring): ``[sources, depth]`` per position, for a policy to :func:`merge` by how well each source did earlier
    in the prompt."""

    def __init__(
        self,
        model: LoadedModel,
        layer: Layer,
        observed: Sequence[torch.Tensor],
        depth: int = 2048,
        reading: Reading | None = None,
        fused: float = 0.0,
    ) -> None:
        probe = model.probe
        self.depth = min(depth, probe.vocab_size)
        self.rows = list(range(len(observed)))  # which prompts are still being inverted
        self._orders: list[torch.Tensor] = []  # per prompt [T_i - 1, sources, depth]: positions 1..T_i-1
        self._firsts: list[list[list[int]]] = []  # per prompt and position 1..T_i-1: each source's first guess
        self._readings: list[torch.Tensor | None] = []  # per prompt [T_i, d]: what the reading reads, when given
        per_batch = max(1, TOKENS // max(1, max(len(s) for s in observed)))
        for first in range(0, len(observed), per_batch):
            group = list(observed[first : first + per_batch])
            longest = max(len(s) for s in group)
            padded = torch.zeros(len(group), longest, probe.hidden_size, device=probe.device)
            for i, s in enumerate(group):  # right-padded: causal attention keeps the real positions as they are
                padded[i, : len(s)] = s.to(device=probe.device, dtype=torch.float32)
            last = probe.final_from(padded, layer)
            for i, s in enumerate(group):
                logits = probe.next_token_logits(last[i, : len(s) - 1], normed=True).float()
                order = logits.topk(self.depth, dim=-1).indices
                firsts = order[:, :1]
                if reading is not None:  # what the position's own state reads as: a second source
                    vectors = read(reading, s.to(probe.device))
                    distances = input_distances(model, vectors[1:])
                    ranked = distances.topk(self.depth, dim=1, largest=False).indices.to(order.device)
                    sources = [order, ranked]
                    firsts = torch.cat([ranked[:, :1], firsts], dim=1)
                    if fused > 0:  # both, as a product of experts: a third source
                        both = fuse(logits.log_softmax(-1), reading_log_probs(distances), fused)
                        sources.append(both.topk(self.depth, dim=-1).indices)
                        firsts = torch.cat([firsts, sources[-1][:, :1]], dim=1)
                    order = torch.stack(sources, dim=1)
                    self._readings.append(vectors)
                else:
                    order = order[:, None]
                    self._readings.append(None)
                self._orders.append(order)
                self._firsts.append(firsts.tolist())

    def orders(self, position: int) -> torch.Tensor | None:
        """``[rows, sources, depth]``: the most likely tokens at ``position`` of each prompt still inverted by each
        source (the next-token prior's, then the reading's, then both fused; most likely first), on the model's
        device; None at position 0."""
        if position == 0:
            return None
        return torch.stack([self._orders[i][position - 1] for i in self.rows])

    def firsts(self, prompt: int) -> list[list[int]]:
        """Prompt ``prompt``'s first guesses at positions 1..T-1 (row ``t - 1``), one per source: the reading map's
        (when given), then the model's next-token prior's, then both fused (when asked) (:mod:`.speculation`
        verifies them in chains)."""
        return self._firsts[prompt]

    def readings(self, prompt: int) -> torch.Tensor | None:
        """Prompt ``prompt``'s readings ``[T, d]``: the input vector the reading reads from each position's observed
        state (float32; None without a reading)."""
        return self._readings[prompt]

    def select(self, keep: Sequence[int]) -> None:
        """Only prompts ``keep`` (indices into the current rows) are inverted from now on."""
        self.rows = [self.rows[k] for k in keep]

    def order(self, position: int) -> torch.Tensor | None:
        """The order of a single prompt (one row)."""
        orders = self.orders(position)
        return None if orders is None else orders[0]
