"""Results of an inversion: per position and per prompt (frozen, JSON-ready)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from .acceptor import VERDICTS

# the reason of a position another search decided, taken as it is: a placeholder (uncertain, no evidence) that the
# caller replaces with that search's own (InvertConfig.known, RowSearch.run's known; leaks.sink_retry)
KNOWN = "sure by another search, taken as it is"


@dataclass(frozen=True)
class PositionResult:
    """What happened at one position.

    ``distance`` is the L2 distance between the accepted candidate's verified state and the observed state;
    ``margin`` the distance of the best *rejected* candidate that was checked (inf if none was; where the scout's
    guess was the token, the candidates it rejected count, at their distances with bfloat16 GEMMs);
    ``verdict`` is the acceptor's (:mod:`lminvert.invert.acceptor`: certified, confident or uncertain) and ``reason``
    why; ``uncertain`` is ``verdict == "uncertain"``.
    ``confirmed`` counts the candidates whose states were recomputed by a plain uncached forward of prefix +
    candidate (see :mod:`lminvert.invert.search`); ``plain_distance`` is the accepted token's distance under it
    (JSON ``plain_distances``: a ``certified`` position reproduced by the plain forward has 0 there, whatever
    ``distance`` the search's batched, cached forward measured).
    ``candidates_checked`` counts every candidate run through the model at the position, ``screened_out`` of them
    only with bfloat16 GEMMs (screening, :mod:`lminvert.invert.engine`: their screened states ruled them out; never
    the accepted token), ``scouted`` of them by the scout (:mod:`lminvert.invert.scout`); ``forwards`` counts the
    scout's forwards at the position too (and position 0 the forward that checks its guess).
    """

    token_id: int
    distance: float
    margin: float
    tolerance: float
    candidates_checked: int
    uncertain: bool
    noise_norm: float | None = None
    # half the gap between the accepted state and the nearest other checked state (Theorem 3.2's Delta/2 when
    # whole_vocabulary: every vocabulary entry was checked); noise below it cannot change the answer. None without
    # clean states, or when no other candidate was checked (no gap measured: e.g. a position decided by a chain's state)
    certified_radius: float | None = None
    whole_vocabulary: bool = False
    tied_with: tuple[int, ...] = ()  # other tokens with a bit-identical input vector: indistinguishable by any state
    confirmed: int = 0  # candidates re-measured by the plain forward at this position
    plain_distance: float | None = None  # the token's plain-forward distance, where it was re-measured
    confirm_tolerance: float | None = None  # the plain forward's acceptance radius
    speculated: bool = False  # the token's verified state came from a chain of first guesses (one forward, several
    # positions: :mod:`lminvert.invert.speculation`)
    forwards: int = 0  # forwards this position waited for (verification, confirmation, prefix extension): on a GPU,
    # where a forward costs about the same for 1 or 1,024 candidates, the sequential rounds that set the time
    ranking_seconds: float = 0.0  # proposing candidates (fits, ranking, the next-token prior)
    verification_seconds: float = 0.0  # batched forwards of the candidates and their distances
    extension_seconds: float = 0.0  # extending the prefix's KV cache by the accepted token
    screened_out: int = 0  # candidates only screened (bfloat16 GEMMs), counted in candidates_checked
    scouted: int = 0  # candidates the scout ran here (bfloat16 GEMMs, :mod:`lminvert.invert.scout`), counted too
    # the time bound stopped the engine's search here or earlier: its candidate may be wrong (the rows search's bound
    # is said in the result's notes alone)
    stopped: bool = False
    verdict: str = "uncertain"  # certified, confident or uncertain (:mod:`lminvert.invert.acceptor`)
    reason: str = ""  # the acceptor's reason for it


@dataclass(frozen=True)
class InversionResult:
    """The recovered prompt and how it was found."""

    token_ids: list[int]
    text: str
    seconds: float
    positions: list[PositionResult]
    layer: str
    model: str
    method: str
    policy: str
    vocab_size: int
    dtype: str = "float32"
    device: str = "cpu"
    source: str = "exact"  # the error model the states were inverted under (:mod:`lminvert.invert.sources`)
    notes: tuple[str, ...] = ()  # what the result as a whole says about the states (e.g. they do not fit the model)

    @property
    def candidates_checked(self) -> list[int]:
        return [p.candidates_checked for p in self.positions]

    @property
    def forwards(self) -> int:
        """Forwards the prompt waited for, all positions (shared with the prompts inverted together)."""
        return sum(p.forwards for p in self.positions)

    @property
    def distances(self) -> list[float]:
        return [p.distance for p in self.positions]

    @property
    def margins(self) -> list[float]:
        return [p.margin for p in self.positions]

    @property
    def time_split(self) -> dict[str, float]:
        """Seconds over all positions: ranking, verification, prefix extension (the rest is set-up)."""
        return {
            "ranking": sum(p.ranking_seconds for p in self.positions),
            "verification": sum(p.verification_seconds for p in self.positions),
            "extension": sum(p.extension_seconds for p in self.positions),
        }

    @property
    def whole_vocabulary(self) -> bool:
        """Every position was checked against the whole vocabulary (``certify=True``): no other token's state matches
        as well (without it, each position is exact given that the model is injective, which SIPIT's early stop relies
        on). Not the ``certified`` verdict, which says a position's state was reproduced bit for bit."""
        return all(p.whole_vocabulary for p in self.positions)

    @property
    def verdicts(self) -> list[str]:
        return [p.verdict for p in self.positions]

    @property
    def verdict_counts(self) -> dict[str, int]:
        """How many positions got each verdict (every verdict named, zero included)."""
        return {v: self.verdicts.count(v) for v in VERDICTS}

    @property
    def uncertain_positions(self) -> list[int]:
        return [i for i, p in enumerate(self.positions) if p.uncertain]

    @property
    def explored_fraction(self) -> float:
        """Mean fraction of the vocabulary verified per position."""
        return sum(self.candidates_checked) / (len(self.positions) * self.vocab_size)

    def to_json(self) -> dict:
        out = {
            "token_ids": self.token_ids,
            "text": self.text,
            "seconds": round(self.seconds, 4),
            "candidates_checked": self.candidates_checked,
            "distances": self.distances,
            "plain_distances": [p.plain_distance for p in self.positions],
            "margins": [m if m != float("inf") else None for m in self.margins],
            "uncertain_positions": self.uncertain_positions,
            "verdicts": self.verdicts,
            "verdict_counts": self.verdict_counts,
            "reasons": [p.reason for p in self.positions],
            "source": self.source,
            "notes": list(self.notes),
            "whole_vocabulary": self.whole_vocabulary,
            "explored_fraction": self.explored_fraction,
            "time_split": {k: round(v, 4) for k, v in self.time_split.items()},
            "confirmed": [p.confirmed for p in self.positions],
            "screened_out": [p.screened_out for p in self.positions],
            "forwards": self.forwards,
            "speculated_positions": [i for i, p in enumerate(self.positions) if p.speculated],
            "layer": self.layer,
            "model": self.model,
            "method": self.method,
            "policy": self.policy,
            "dtype": self.dtype,
            "device": self.device,
        }
        ties = {i: list(p.tied_with) for i, p in enumerate(self.positions) if p.tied_with}
        if ties:
            out["tied_alternatives"] = ties
        if any(p.stopped for p in self.positions):  # the time bound's: their candidates may be wrong
            out["stopped_positions"] = [i for i, p in enumerate(self.positions) if p.stopped]
        if any(p.noise_norm is not None for p in self.positions):
            out["noise"] = [
                {
                    "noise_norm": p.noise_norm,
                    "certified_radius": p.certified_radius,
                    "whole_vocabulary": p.whole_vocabulary,
                    "below_certified_radius": None
                    if p.certified_radius is None or p.noise_norm is None
                    else p.noise_norm < p.certified_radius,
                }
                for p in self.positions
            ]
        return out

    def as_dict(self) -> dict:
        return asdict(self)


class Clock:
    """Seconds spent per kind of work at one position (ranking, verification, prefix extension)."""

    def __init__(self) -> None:
        self.seconds = {"ranking_seconds": 0.0, "verification_seconds": 0.0, "extension_seconds": 0.0}
        self.forwards = 0  # forwards waited for

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[f"{kind}_seconds"] += seconds

    @contextlib.contextmanager
    def __call__(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - start)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
