"""What a candidate policy sees at one position: the prefix, the target, and every verified candidate.

Everything here lives on the model's device (ids, states, distances), so that policies rank where the model runs.
Distances are measured in float64 (float32 on MPS, which has no float64).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import LayerProbe, Prefix

BATCH_SCALE = {"cpu": 1, "cuda": 16, "mps": 4}  # verification batch sizes relative to a CPU's (see batch_scale)


def batch_scale(device: torch.device, prompts: int = 1) -> int:
    """How much larger each prompt's candidate batches are on ``device`` than on a CPU, with ``prompts`` inverted
    together. A CPU's verification cost grows with the batch, so small batches that stop at the first match are
    cheapest there; a GPU's is latency-bound (one forward of 1 or 1,024 candidates costs about the same), so it
    pays to verify more candidates per sequential round: on CUDA one prompt's first batch at a position holds the
    top 256 of its ranking instead of 16. Prompts inverted together already fill the forward, so the scale shrinks
    with their number (16 prompts or more: a CPU's batches)."""
    return max(1, BATCH_SCALE.get(device.type, 1) // max(1, prompts))


def wide_dtype(device: torch.device) -> torch.dtype:
    """The most precise float dtype on ``device`` (float64; float32 on MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class PositionContext:
    """Mutable per-position bookkeeping, owned by the engine; policies read it."""

    probe: LayerProbe
    prefix: Prefix  # the recovered prefixes of every prompt advanced together
    row: int  # this prompt's row of ``prefix``
    target: torch.Tensor  # observed state [d] (float32, on the model's device)
    tolerance: float  # acceptance: a candidate whose verified state lies within this L2 distance of the target
    position: int
    generator: torch.Generator  # CPU: the same random draws on every device
    next_tokens: torch.Tensor | None = None  # the model's own next-token order at this position, if asked
    scale: int = 1  # candidate batches are this many times a CPU's (:func:`batch_scale`)
    seen: torch.Tensor = field(init=False)  # [V] bool: already verified
    ids: list[torch.Tensor] = field(default_factory=list)  # verified ids, per batch
    states: list[torch.Tensor] = field(default_factory=list)  # their verified states (float32), per batch
    dists: list[torch.Tensor] = field(default_factory=list)  # their distances to target (wide dtype), per batch
    given: int = 0  # batches recorded that no policy proposed (a chain's state: :mod:`.speculation`)
    screened: int = 0  # candidates screened out (seen, not verified, not recorded: :mod:`.search`)
    best_id: int = -1
    best_dist: float = float("inf")
    best_state: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.seen = torch.zeros(self.probe.vocab_size, dtype=torch.bool, device=self.probe.device)

    @property
    def device(self) -> torch.device:
        return self.probe.device

    @property
    def checked(self) -> int:
        return int(sum(len(i) for i in self.ids))

    @property
    def forwarded(self) -> int:
        """Candidates run through the model at this position: verified, or screened out."""
        return self.checked + self.screened

    @property
    def rounds(self) -> int:
        """Batches the policy proposed at this position so far."""
        return len(self.ids) - self.given

    @property
    def accepted(self) -> bool:
        return self.best_dist <= self.tolerance

    def continuation(self, token_ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """States of one-token continuations of this prompt's prefix (ids or input vectors)."""
        count = len(token_ids) if token_ids is not None else len(embeds)  # type: ignore[arg-type]
        rows = None if self.prefix.size == 1 else torch.full((count,), self.row, device=self.device)
        out = self.probe.continuation(self.prefix, token_ids=token_ids, embeds=embeds, rows=rows)
        assert isinstance(out, torch.Tensor)
        return out

    def distances(self, states: torch.Tensor) -> torch.Tensor:
        """L2 distances of verified states ``[B, d]`` to the target."""
        wide = wide_dtype(self.device)
        return (states.to(wide) - self.target.to(wide)).norm(dim=1)

    def record(self, ids: torch.Tensor, states: torch.Tensor, dists: torch.Tensor, given: bool = False) -> None:
        """Verified ``ids``: their states and distances (``given``: not proposed by the policy)."""
        self.given += given
        self.seen[ids] = True
        self.ids.append(ids)
        self.states.append(states)
        self.dists.append(dists)
        if not len(ids):  # a screened batch none of whose candidates was verified
            return
        value, index = dists.min(dim=0)
        value = float(value)  # one host sync per batch
        if value < self.best_dist:
            self.best_dist, self.best_id = value, int(ids[index])
            self.best_state = states[index]

    def all_ids(self) -> torch.Tensor:
        return torch.cat(self.ids) if self.ids else torch.empty(0, dtype=torch.long, device=self.device)

    def all_states(self) -> torch.Tensor:
        if self.states:
            return torch.cat(self.states)
        return torch.empty(0, self.probe.hidden_size, device=self.device)

    def all_dists(self) -> torch.Tensor:
        return (
            torch.cat(self.dists) if self.dists else torch.empty(0, dtype=wide_dtype(self.device), device=self.device)
        )

    def unseen(self, ranked: torch.Tensor, k: int) -> torch.Tensor:
        """The first ``k`` ids of ``ranked`` not yet verified."""
        keep = ranked[~self.seen[ranked]]
        return keep[:k]
