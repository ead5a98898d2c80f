"""The order of a prompt's tokens from the first block's attention weights (:mod:`.firstblock`).

The last position's weight on position ``j`` in head ``h`` is ``exp(s[h, t_j, j]) / Z_h``, with ``s`` the query-key
logit of token ``t_j`` at ``j`` (known for every token and position) and ``Z_h`` the head's normaliser. A token's
fitted weight is the sum over the positions it holds. So:

* ``log Z_h`` is read where most tokens agree: each (token, position) pair implies ``s - log(weight)`` in every head,
  and the right pairs of the tokens that occur once imply the same vector (:func:`_normalisers`, a few best
  hypotheses; and the one the last token implies where it occurs only last);
* positions are then filled left to right by a beam that keeps the assignments whose tokens' accumulated weights
  overshoot their fitted ones least (:func:`_beam`); the complete ones are ranked by the fitted weights' squared
  error under the exact softmax.

Proposals only: each is verified by a forward and judged by the acceptor.
"""

from __future__ import annotations

import torch

BEAM = 512  # partial assignments kept per position
TOP = 64  # prompts proposed per length
HYPOTHESES = 3  # normalisers tried from the tokens' agreement (besides the last token's)
AGREE = 0.15  # a pair agrees with a normaliser within this weighted RMS of its logs
PRESENT = 0.02  # a token whose weight reaches this in some head is taken to occur in the prompt


def orders(logits: torch.Tensor, weights: torch.Tensor, tokens: list[int], last: int) -> list[tuple[int, ...]]:
    """Up to ``TOP`` prompts of ``logits.shape[2]`` tokens over ``tokens`` (the last one ``tokens[last]``), best
    first. ``logits``: ``[heads, n, L]``; ``weights``: the fitted ``[heads, n]``."""
    observed = weights.double().clamp(min=0)
    ranked: dict[tuple[int, ...], float] = {}
    for normaliser in _normalisers(logits, observed, last):
        for seq, cost in _beam(logits, observed, last, normaliser):
            prompt = tuple(tokens[i] for i in seq)
            ranked[prompt] = min(cost, ranked.get(prompt, float("inf")))
    return sorted(ranked, key=ranked.__getitem__)[:TOP]


def _normalisers(logits: torch.Tensor, observed: torch.Tensor, last: int) -> list[torch.Tensor]:
    """``log Z`` hypotheses ``[heads]``: the last token's (its weight all at the last position), then those most
    (token, position) pairs agree with."""
    length = logits.shape[2]
    weights = observed.clamp(min=1e-6)
    implied = logits - weights.log()[:, :, None]  # [heads, n, L]
    share = weights / weights.sum(0, keepdim=True)  # each token's heads weighted by its weight there
    present = [t for t in range(weights.shape[1]) if float(observed[:, t].max()) > PRESENT]
    out = [implied[:, last, length - 1]]
    pairs = [(t, j) for t in present for j in range(length) if j < length - 1 or t == last]
    scored = []
    for t, j in pairs:
        guess = implied[:, t, j]
        spread = ((implied[:, present] - guess[:, None, None]) ** 2 * share[:, present, None]).sum(0).sqrt()
        agree = spread.min(1).values < AGREE
        scored.append((int(agree.sum()), -float(spread.min(1).values[agree].sum()), t, j))
    scored.sort(reverse=True)
    out += [implied[:, t, j] for _, _, t, j in scored[:HYPOTHESES]]
    return out


def _beam(
    logits: torch.Tensor, observed: torch.Tensor, last: int, normaliser: torch.Tensor
) -> list[tuple[list[int], float]]:
    """Assignments of the positions before the last, left to right, under the normaliser ``log Z``: each token's
    weight accumulated; those overshooting the fitted weights least kept. The complete ones with their exact cost."""
    heads, n, length = logits.shape
    share = torch.exp(logits - normaliser[:, None, None])  # [heads, n, L]: a token's weight at a position
    accumulated = torch.zeros(1, heads, n, dtype=torch.float64)
    accumulated[0, :, last] += share[:, last, length - 1]
    seqs = torch.zeros(1, 0, dtype=torch.long)
    rows = torch.arange(n)
    for j in range(length - 1):
        grown = accumulated[:, None].repeat(1, n, 1, 1)  # [b, n (token placed), heads, n]
        grown[:, rows, :, rows] += share[:, :, j].T[:, None, :]  # token t placed at j adds to its own weight
        over = (grown - observed).clamp(min=0).pow(2).sum((2, 3)).reshape(-1)
        keep = over.topk(min(BEAM, over.numel()), largest=False).indices
        accumulated = grown.reshape(-1, heads, n)[keep]
        seqs = torch.cat([seqs[keep // n], (keep % n)[:, None]], dim=1)
    full = torch.cat([seqs, torch.full((len(seqs), 1), last)], dim=1)  # [P, L]
    scores = logits[:, full, torch.arange(length)]  # [heads, P, L]
    attention = torch.softmax(scores, dim=-1)
    predicted = torch.zeros(heads, len(full), n, dtype=torch.float64)
    predicted.scatter_add_(2, full[None].expand(heads, -1, -1), attention)
    cost = ((predicted - observed[:, None]) ** 2).sum((0, 2))
    order = cost.argsort()[:TOP]
    return [(full[i].tolist(), float(cost[i])) for i in order]
