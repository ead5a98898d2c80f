"""Speculative verification: the first guesses of the next positions verified in the same forward as this position's
first batch, as speculative decoding verifies a draft.

The proposals of every position are read from the observed states before the search starts (the reading map and the
model's next-token prior, :mod:`.proposal`), not from the recovered prefix, so at position ``t`` the first guesses
``g_{t+1}, g_{t+2}, ...`` of the next positions are already known. When the policy proposes its first batch at ``t``
(a few candidates ``c``), each candidate is verified as a chain ``c, g_{t+1}, .., g_{t+K-1}`` in one forward over the
cached prefix (:meth:`LayerProbe.chains`): its state at ``t`` is ``c``'s verification, and its state at ``t + j`` is
that of ``g_{t+j}`` after the prefix grown by ``c, g_{t+1} .. g_{t+j-1}``: the verification the search would run at
``t + j`` once those tokens are decided. So when ``t`` is decided as one of the chains' first tokens, that chain's
states are recorded at the next positions as their first verified candidates (without a forward), and the acceptance
test decides as for any other candidate (:mod:`.search`; the radii are measured on chains too, :mod:`.tolerance`): a
wrong guess costs time, never the answer. At the first position decided otherwise, the rest is dropped (its states
followed another prefix). Chain keys and values grow the prefix as a verification's do.

The same guesses ride, for free, on the plain forwards that confirm a contender (:mod:`.search`: in half precision every
position is confirmed). Such a forward recomputes the observer's whole sequence, shaped like the observer's (the
prefix, the contender, and tokens up to the observed length, whose states cannot change the contender's): filled with
the first guesses ``g_{t+1}, ..`` instead of copies of the contender, its states at ``t + 1, ..`` are those the
observer computed if the contender and the guesses are right, bit for bit where the observer is reproduced. They are
recorded at the next positions as their first verified candidates *with* their plain distances, so a right guess that
reproduces the observation is decided without any verification or confirmation forward (:meth:`Speculator.fill`),
and its keys and values join the prefix's cache with the next forward that needs them, several such tokens in one
(:meth:`LayerProbe.defer`).

Where chains of different lengths can be packed into one row of the forward over the shared prefix (a tree:
:meth:`lminvert.models.LayerProbe.packs_chains`), only the candidates a source guessed first carry the chain (the
reading map's and the prior's first guesses, :meth:`Speculator.roots`) and the others stand alone: the forward holds
the candidates plus one or two chains' tokens, not the candidates times the chain's length, so chains ride on first
batches of several candidates too.

Which guesses, how many: the source (reading map or prior) whose first guesses were right more often in this prompt
so far (a running rate, each position weighing half); chains of about ``2 / (1 - rate)`` positions, at most
``TOKENS`` long (times the device's batch scale; without a tree, ``TOKENS`` tokens in all per prompt and forward);
none while the rate is below ``MIN_RATE`` (random token ids: after a miss or two; ``TREE_RATE`` in a tree). On this
project's 2-core CPU a forward's cost grows with the tokens it holds (SmolLM2, layer 15: 38 / 51 / 66 / 67 / 87 ms
for 1 / 2 / 4 / 8 / 16), on a GPU hardly at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..models import LayerProbe, NewKeys

MIN_RATE = 0.5  # no chains while the better source's running rate of right first guesses is below this
TREE_RATE = 0.25  # ... in a tree, where a chain costs its own tokens only (measurements: docs/history.md, "Constants")
START = 0.25  # the running rates before the first position is decided (one right guess to start chains)
TOKENS = 8  # chain tokens per prompt and forward (times the device's batch scale)

Entry = tuple[int, torch.Tensor, "NewKeys | None"]  # a chain's (token, verified state, keys and values) at a position


def chains_reproduce(probe: LayerProbe) -> bool:
    """Whether chains and their deferred keys reproduce the observer's states as a verification does: on a CPU (its
    kernels compute each row alone, whatever the forward's shape) or in float32 (the calibrated radii cover the rest).
    A half-precision model on a GPU is neither: its GEMMs round a row differently in forwards of other shapes, and a
    prefix grown from a chain then leaves the true token outside a bit-exact ball (docs/results.md, "On a GPU"). The
    engine does not speculate there (speed only: the answer never depends on it)."""
    return probe.device.type == "cpu" or probe.dtype == torch.float32


def _entries(tail: list[int], states: torch.Tensor, keys: Callable[[int], list], i: int) -> Callable[[], list[Entry]]:
    """Root ``i``'s entries at the next positions, made when asked for."""
    return lambda: [(token, states[j], k) for j, (token, k) in enumerate(zip(tail, keys(i), strict=True))]


class _Track:
    """States computed ahead for the positions to come, from one kind of forward (chains or plain confirmations): per
    candidate of the current position, its entries at the next positions; once a position is decided, the decided
    candidate's entries are followed, one per position, until a position is decided as another token."""

    def __init__(self) -> None:
        # candidate at the current position -> its entries at the next ones (made when it is decided)
        self.ahead: dict[int, Callable[[], list[Entry]]] = {}
        self.pending: list[Entry] = []  # the decided candidate's entries, next position first
        self.current: Entry | None = None  # the entry taken at the position being searched

    def take(self) -> Entry | None:
        self.current = self.pending.pop(0) if self.pending else None
        return self.current

    def decided(self, token: int) -> None:
        current, self.current = self.current, None
        ahead, self.ahead = self.ahead, {}
        if token in ahead:
            self.pending = ahead[token]()
        elif current is None or current[0] != token:
            self.pending = []


class Speculator:
    """One prompt's chains: which guesses to verify next, and the states chains (and confirmations filled with the
    guesses) computed for positions to come."""

    def __init__(self, firsts: list[list[int]], scale: int = 1) -> None:
        self.firsts = firsts  # row t - 1: each source's first guess at position t
        self.rates = [START] * (len(firsts[0]) if firsts else 0)
        self.tokens = TOKENS * scale
        self.chains = _Track()  # cached chains' states, with their keys and values
        self.plain = _Track()  # plain forwards' states (confirmations), without keys
        self.seeded = False  # the plain track follows the scout's whole-prompt guess (:meth:`seed`)

    @property
    def plain_ahead(self) -> bool:
        """A plain forward's state waits for the next position."""
        return bool(self.plain.pending)

    def _guesses(self, start: int, stop: int) -> list[int]:
        """The better source's first guesses at positions ``start .. stop - 1``."""
        source = self.rates.index(max(self.rates))
        return [self.firsts[t - 1][source] for t in range(start, stop)]

    def tail(self, position: int, length: int, roots: int, tree: bool = False) -> list[int] | None:
        """The guesses at positions ``position + 1 ..`` that should follow each of ``roots`` candidates verified at
        ``position`` of a prompt of ``length`` positions, or None (no chain). In a tree (:meth:`roots`) give
        ``roots = 1`` and ``tree``: the chain's length does not depend on how many candidates stand alone beside it,
        and a lower rate (``TREE_RATE``) starts one."""
        if not self.rates or position == 0 or position + 1 >= length:
            return None
        rate = max(self.rates)
        if rate < (TREE_RATE if tree else MIN_RATE):
            return None
        wanted = 2.0 / max(1.0 - rate, 1.0 / self.tokens)
        size = min(length - position, self.tokens // roots, 1 << math.ceil(math.log2(wanted)))
        if size < 2:
            return None
        return self._guesses(position + 1, position + size)

    def roots(self, position: int, candidates: list[int]) -> list[int]:
        """Which of the ``candidates`` verified at ``position`` carry the chain in a tree (the others stand alone):
        those that a source guessed first there (the better source's first), else the first candidate."""
        if not self.rates or not 1 <= position <= len(self.firsts):
            return [0]
        ranked = sorted(range(len(self.rates)), key=lambda source: -self.rates[source])
        guesses = dict.fromkeys(self.firsts[position - 1][source] for source in ranked)
        found = [candidates.index(guess) for guess in guesses if guess in candidates]
        return found or [0]

    def fill(self, position: int, length: int) -> list[int]:
        """The better source's first guesses at positions ``position + 1 .. length - 1`` (the tokens after a contender
        in the plain forward that confirms it: free, that forward holds the whole observed length anyway)."""
        if not self.rates or position + 1 >= length:
            return []
        return self._guesses(position + 1, length)

    def store_plain(self, root: int, tail: list[int], states: torch.Tensor) -> None:
        """The plain forward confirming ``root`` at the current position computed the states ``[len(tail), d]`` of
        ``tail`` (:meth:`fill`) at the next positions."""
        self.plain.ahead[root] = lambda: [(token, states[j], None) for j, token in enumerate(tail)]

    def store(
        self, roots: list[int], tail: list[int], states: torch.Tensor, keys: Callable[[int], list[NewKeys | None]]
    ) -> None:
        """Chains verified from the current position: ``roots`` (its candidates) each followed by ``tail``, their
        states at the next positions ``[B, K-1, d]``, and ``keys(i)``: root ``i``'s keys and values at each of those
        positions (asked for only for the root the position is decided as)."""
        self.chains.ahead = {root: _entries(tail, states[i], keys, i) for i, root in enumerate(roots)}

    def seed(self, guess: list[int], states: torch.Tensor) -> None:
        """A whole-prompt guess from position 0 (the scout's, :mod:`.scout`) and its plain forward's states
        ``[len(guess), d]``: each position takes its guess's state first, until a position is decided as another
        token."""
        self.plain.pending = [(token, states[t], None) for t, token in enumerate(guess)]
        self.seeded = True

    def take(self) -> tuple[Entry | None, Entry | None]:
        """The (token, state, keys) at the position to search now of the decided chain and of the decided contender's
        plain forward (keys None), each if any."""
        return self.chains.take(), self.plain.take()

    def decided(self, position: int, token: int) -> None:
        """Position ``position`` was decided as ``token``: update the rates; follow the chain (and the plain forward)
        that starts (or goes on) with ``token``, drop every other."""
        if 1 <= position <= len(self.firsts):
            for source, guess in enumerate(self.firsts[position - 1]):
                self.rates[source] = 0.5 * self.rates[source] + 0.5 * (guess == token)
        self.chains.decided(token)
        current = self.plain.current
        self.plain.decided(token)
        if current is None or current[0] != token:  # the guess was wrong here: the plain track is a confirmation's now
            self.seeded = False
