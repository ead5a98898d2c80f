"""What a candidate policy sees at one position: the prefix, the target, and every verified candidate."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import LayerProbe, Prefix


@dataclass
class PositionContext:
    """Mutable per-position bookkeeping, owned by the engine; policies read it."""

    probe: LayerProbe
    prefix: Prefix
    target: torch.Tensor  # observed state [d] (float32)
    tolerance: float  # acceptance: a candidate whose state lies within this L2 distance of the target
    position: int
    generator: torch.Generator
    seen: torch.Tensor = field(init=False)  # [V] bool: already verified
    ids: list[torch.Tensor] = field(default_factory=list)  # verified ids, per batch
    states: list[torch.Tensor] = field(default_factory=list)  # their verified states, per batch
    dists: list[torch.Tensor] = field(default_factory=list)  # their distances to target (float64), per batch
    best_id: int = -1
    best_dist: float = float("inf")
    best_state: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.seen = torch.zeros(self.probe.vocab_size, dtype=torch.bool)

    @property
    def checked(self) -> int:
        return int(sum(len(i) for i in self.ids))

    @property
    def accepted(self) -> bool:
        return self.best_dist <= self.tolerance

    def record(self, ids: torch.Tensor, states: torch.Tensor, dists: torch.Tensor) -> None:
        self.seen[ids] = True
        self.ids.append(ids)
        self.states.append(states)
        self.dists.append(dists)
        value, index = dists.min(dim=0)
        value = float(value)  # one host sync per batch
        if value < self.best_dist:
            self.best_dist, self.best_id = value, int(ids[index])
            self.best_state = states[index]

    def all_ids(self) -> torch.Tensor:
        return torch.cat(self.ids) if self.ids else torch.empty(0, dtype=torch.long)

    def all_states(self) -> torch.Tensor:
        return torch.cat(self.states) if self.states else torch.empty(0, self.probe.hidden_size)

    def all_dists(self) -> torch.Tensor:
        return torch.cat(self.dists) if self.dists else torch.empty(0, dtype=torch.float64)

    def unseen(self, ranked: torch.Tensor, k: int) -> torch.Tensor:
        """The first ``k`` ids of ``ranked`` not yet verified."""
        keep = ranked[~self.seen[ranked]]
        return keep[:k]
