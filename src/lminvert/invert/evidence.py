"""What a position's search hands the acceptor, and what the acceptor answers: data only (the rule and every threshold
of it: :mod:`.acceptor`, which re-exports these)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

NO_FIT = "no candidate fits the error model"  # a decision's reason: nothing within the error model


@dataclass(frozen=True)
class Evidence:
    """What the search knows at one position."""

    ids: torch.Tensor  # verified ids [n]
    dists: torch.Tensor  # their cached distances [n]
    # their verified states [n, d], or a function giving them (read only to order several contenders by angle: the
    # engine's searches concatenate them only then)
    states: torch.Tensor | Callable[[], torch.Tensor]
    target: torch.Tensor  # the observed state [d]
    plain: dict[int, float]  # plain distances of the contenders re-measured so far
    reach: float  # cached distances up to which candidates are contenders (>= radii.cached)
    reproducible: bool  # the error model says a plain forward can reproduce the observation (lminvert's own states)
    exhaustive: bool = False  # the whole budget is verified before deciding (brute force, certify)
    exhausted: bool = False  # no candidate will come any more
    swept: bool = False  # every vocabulary entry was verified
    confirmed: bool = False  # a plain forward ran at this position
    checked: int = 0  # candidates run through the model at this position (verified or screened out)
    ranked: bool = True  # a batch of the ranking's top candidates was verified (not only a chain's first guess)
    # a search whose ranking puts the true token among its first candidates gives up after ``acceptor.GIVE_UP`` of
    # them where the source cannot be reproduced (False: an order that does not, e.g. the reference's random one)
    bounded: bool = True
    # an earlier position of the prompt fitted the error model (certified or confident): the states match this model's
    # computation, so a position where nothing fits yet is searched through the budget, not given up at
    # ``acceptor.GIVE_UP``
    fitted: bool = False
    reproduced: bool = False  # an earlier position of the prompt was reproduced bit for bit
    twins: dict[int, tuple[int, ...]] = field(default_factory=dict)  # tokens with identical input vectors
    # distances are measured beyond a box the error model allows coordinate by coordinate (a quantisation's): a
    # distance of 0 reproduces nothing, it only says the row fits
    boxed: bool = False
    # how far the true token's plain state lay from the observation in the error model's own measurement (its bound
    # without the safety factor: :meth:`lminvert.invert.sources.ErrorModel.measured`; inf: no such figure); while the
    # candidates that fit all lie beyond it, the search goes on past ``acceptor.RIVALS`` up to ``acceptor.FAR``
    expected: float = math.inf
    guessed: bool = False  # an earlier position of the prompt was a guess (several fit, or none)
    # the candidates are whole prompts (one vector: :mod:`.last`): those not tried are not ruled out by those tried
    # (only a reproduction certifies; ``confident``: :func:`.acceptor._verdict`, ``Radii.gap`` from :mod:`.wholegap`)
    whole: bool = False
    # the search can re-measure any verified candidate by a plain forward, within the reach or not (the engine's): the
    # acceptor may then ask for candidates outside the reach where nothing lies within it (:func:`.acceptor._near`)
    remeasurable: bool = False

    def by_angle(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` (into the verified candidates) ordered by their states' cosine with the observation, largest
        first."""
        if len(index) < 2:
            return index
        wide = self.dists.dtype
        states = self.states() if callable(self.states) else self.states
        cosine = torch.nn.functional.cosine_similarity(states[index].to(wide), self.target.to(wide)[None])
        return index[cosine.argsort(descending=True)]


@dataclass(frozen=True)
class Decision:
    """A token and its verdict, or what is still needed (``confirm``: contenders to re-measure; neither: more
    candidates). ``guess``: the token was one of several that fit, so later positions are found given a guess."""

    token: int | None = None
    verdict: str | None = None
    confirm: tuple[int, ...] = ()
    guess: bool = False
    reason: str = ""

    @property
    def final(self) -> bool:
        return self.token is not None

    @property
    def unfitted(self) -> bool:
        """Decided with no candidate within the error model (the nearest, as a guess)."""
        return self.reason == NO_FIT


PENDING = Decision()


@dataclass(frozen=True)
class NextRow:
    """What the next position's row says of the first token, where several fit position 0's own row (an attention
    sink's norm lets noise or quantisation cover the gaps between first tokens there)."""

    # the choice among first tokens by the next row, the next token held fixed: every first token verified under it
    choice: Decision
    following: Decision  # the next position's own decision under the chosen first token
    covered: bool  # every first token within position 0's own error bound was among those verified under it
    # the first token nearest to fitting after the chosen one, given its own search at the next position (a budget
    # of the rankers' first candidates): whether any next token fitted the row under it
    rival_fits: bool
    # the rule (confident where the other fields say so) claimed this many calibration prompts under the same error
    # model, and this many wrongly (None: not measured)
    calibration: tuple[int, int] | None = None
