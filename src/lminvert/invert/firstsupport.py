"""The tokens of a prompt, as a set, from the first block's attention output (:mod:`.firstblock`).

Each head's part of ``z`` (the attention output before ``o_proj``) is a convex combination of the prompt's tokens'
value vectors. :func:`support` finds such tokens among the vocabulary's:

1. **Greedy** (simultaneous orthogonal matching pursuit, every head sharing the support): tokens are added one at a
   time, each the one whose values (less each head's current fit) best explain every head's residual.
2. **Exchange**: a greedy pick made early can be wrong and stay (a true token then finds no room). While the fit has not
   reached ``FITTED``, the ``k`` tokens whose removal costs least (``k`` in ``DROPS``, fewest first) are dropped and the
   support regrown greedily without them; the first exchange that lowers the residual is kept. SmolLM2, 16-token
   held-out prose and code, the fit at the prompt's own residual: the token set whole for 11 of 12 with the exchange,
   7 of 12 without (a ``/tmp`` script).

Free directions (the MLP's weak ones, where the residual is not determined) are part of every fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUM = 10.0  # weight of each head's "weights sum to one" row in the fits
FITTED = 1e-4  # a fit whose residual is under this part of ``z`` is not exchanged further
EXCHANGES = 40  # exchanges kept per support at most
DROPS = (1, 2, 4, 6)  # tokens dropped per exchange tried, in this order
GAIN = 0.999  # an exchange is kept where it multiplies the residual by less than this


def strength(weights: torch.Tensor) -> torch.Tensor:
    """Each support token's largest weight over the heads (``[n]``): how surely the prompt holds it."""
    return weights.abs().max(0).values


def fit(values: torch.Tensor, heads: int, z: torch.Tensor, free: torch.Tensor, support: list[int]):
    """Least squares of ``z`` by each head's combination of the support's values (summing to one), plus any
    combination of the ``free`` directions: weights ``[heads, n]``, the fitted part, the residual, the free
    directions' coefficients. ``values``: ``[V, kv_heads, head_dim]``, every token's."""
    n, kv_heads, dim = len(support), values.shape[1], values.shape[2]
    group, size = heads // kv_heads, heads * dim
    system = torch.zeros(size + heads, heads * n + free.shape[1], dtype=torch.float64)
    chosen = values[support].double()  # [n, kv_heads, head_dim]
    for h in range(heads):
        system[h * dim : (h + 1) * dim, h * n : (h + 1) * n] = chosen[:, h // group].T
        system[size + h, h * n : (h + 1) * n] = SUM
    system[:size, heads * n :] = free
    wanted = torch.cat([z, torch.full((heads,), SUM, dtype=torch.float64)])
    solution = torch.linalg.lstsq(system, wanted[:, None]).solution[:, 0]
    weights = solution[: heads * n].view(heads, n)
    fitted = torch.einsum("hn,nhd->hd", weights, chosen.repeat_interleave(group, 1)).reshape(-1)
    coefficients = solution[heads * n :]
    return weights, fitted, z - fitted - free @ coefficients, coefficients


class _Pursuit:
    """One support search: ``z`` and its free directions, against the vocabulary's ``values``."""

    def __init__(self, values: torch.Tensor, heads: int, z: torch.Tensor, free: torch.Tensor) -> None:
        self.values, self.heads, self.z, self.free = values, heads, z, free
        self.basis = torch.linalg.qr(free).Q.float()  # [d, free]

    def cost(self, support: list[int]) -> float:
        return float(fit(self.values, self.heads, self.z, self.free, support)[2].norm())

    def grow(self, support: list[int], size: int, barred: Sequence[int] = ()) -> list[int]:
        """``support`` grown greedily to ``size`` tokens, none of ``barred``."""
        support = list(support)
        group, dim = self.heads // self.values.shape[1], self.values.shape[2]
        while len(support) < size:
            _, fitted, residual, _ = fit(self.values, self.heads, self.z, self.free, support)
            residual, fitted = residual.float(), fitted.float().view(self.heads, dim)
            along = self.basis.T @ residual
            score = torch.zeros(self.values.shape[0])
            for h in range(self.heads):
                moved = self.values[:, h // group] - fitted[h]  # [V, head_dim]
                inside = moved @ self.basis[h * dim : (h + 1) * dim]  # its part along the free directions
                dot = moved @ residual[h * dim : (h + 1) * dim] - inside @ along
                score += dot.clamp(min=0) ** 2 / ((moved * moved).sum(1) - (inside * inside).sum(1)).clamp_min(1e-12)
            score[support + list(barred)] = -1
            support.append(int(score.argmax()))
        return support

    def exchange(self, support: list[int], cost: float) -> tuple[list[int], float] | None:
        """A support of the same size with a lower residual: the cheapest ``k`` to remove (never the first, the last
        token) dropped and the support regrown, for ``k`` in ``DROPS``; None where none is lower."""
        removal = sorted(range(1, len(support)), key=lambda i: self.cost(support[:i] + support[i + 1 :]))
        for k in DROPS:
            dropped = [support[i] for i in removal[:k]]
            kept = [t for t in support if t not in dropped]
            trial = self.grow(kept, len(support), dropped)
            trial_cost = self.cost(trial)
            if trial_cost < cost * GAIN:
                return trial, trial_cost
        return None


def support(values: torch.Tensor, heads: int, z: torch.Tensor, free: torch.Tensor, last: int, size: int):
    """``size + 1`` tokens, ``last`` first, whose values (each head's combination summing to one) and the ``free``
    directions fit ``z`` best as found (see the module docstring): (tokens, weights ``[heads, n]``, residual norm,
    the free directions' coefficients)."""
    pursuit = _Pursuit(values, heads, z, free)
    tokens = pursuit.grow([last], size + 1)
    cost, tight = pursuit.cost(tokens), FITTED * float(z.norm())
    for _ in range(EXCHANGES):
        better = pursuit.exchange(tokens, cost) if cost > tight else None
        if better is None:
            break
        tokens, cost = better
    weights, _, residual, coefficients = fit(values, heads, z, free, tokens)
    return tokens, weights, float(residual.norm()), coefficients
