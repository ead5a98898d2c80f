"""Candidates run again through the view's own capture, a plain forward shaped like the observer's, where the cached
forward's rounding lets several candidates fit a row that the true token's plain forward reproduces bit for bit.

A half-precision row computed by a cached forward (:meth:`lminvert.models.LayerProbe.continuation`) or by a batched
first-position table need not round as the observer's forward did; the radii hold that rounding (SmolLM2 block 30,
bfloat16: the calibration's worst, times ``SAFETY``, is 22% of a row's norm), and where it is wider than the gap
between the nearest candidates several of them fit. The observer's forward itself is known where the leak is a view's
own rows (no public map): the prompt through the model at its length. A candidate run that way reproduces the row bit
for bit where it is the true token and the kernels are the observer's (SmolLM2 block 30, bfloat16, a transformers
capture of 20 tokens: the prefix, the token and a fill to 20 tokens reproduced rows 1, 5, 10, 15 and 19 of 6 held-out
prompts bit for bit; the prefix and the token alone, 11 tokens, gave 1.1-2.0% of the row's norm below position 15).
The causal mask hides the fill from the row. A reproduction is the acceptor's evidence (its plain distance, within
float32's resolution); nothing else changes: a replay that does not reproduce the row is not recorded, since the
other candidates' distances are cached ones and the acceptor compares them as one kind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..acceptor import Radii
from ..sources import ErrorModel
from .verified import Verified

ALONE = 8  # position 0's nearest candidates within the error bound run alone through the view's own capture, at most
# (SmolLM2 block 15, bfloat16 caches of 6 held-out prompts: the true first token was the table's nearest in all 6; run
# alone it reproduced the cache's row bit for bit in all 6, its batched table row in 2); the same for the nearest of a
# later position where several candidates fit


class Replay:
    """Replays of a rows search's nearest candidates through ``capture`` (a prompt's rows ``[T, k]`` as the view ships
    them; None: no replay) for a source that may be a plain forward's bit for bit (``float``, not noise or
    quantisation)."""

    def __init__(self, capture: Callable[[list[int]], torch.Tensor] | None, source: ErrorModel) -> None:
        self.capture = capture
        self.applies = capture is not None and source.bitwise and not source.boxed
        self.source = source

    def first(self, t: int, seen: Verified, ids: torch.Tensor, dists: torch.Tensor, radii: Radii) -> None:
        """At position 0 (``t``; nothing at later ones), its nearest candidates within the error bound (``ALONE`` at
        most, where the table's nearest does not reproduce the row already) run alone: a plain forward of the token by
        itself, which computes position 0 as any prompt does (attention sees nothing before it) in the shape that
        kernels round alike; their distances replace the batched table's in ``seen.measured`` (the acceptor's plain
        distances), until one reproduces the row bit for bit."""
        if t != 0 or not self.applies or not len(dists):
            return
        near = dists.argsort()
        if float(dists[near[0]]) <= radii.resolution:
            return  # the table's row reproduces it already
        for i in near[:ALONE].tolist():
            if float(dists[i]) > radii.cached:
                break
            token = int(ids[i])
            distance = self._distance([token], 0, seen)
            seen.measured[token] = distance
            if distance <= radii.resolution:
                break

    def later(self, prefix: list[int], length: int, seen: Verified, dists: torch.Tensor, ids: torch.Tensor,
              radii: Radii, lead: int | None = None) -> bool:  # fmt: skip
        """At a later position (after ``prefix``) of a prompt of ``length`` rows, its nearest candidates within the
        cached radius (``ALONE`` at most; ``lead`` first where it was verified, wherever its cached row lies: a token
        another rule chose, the next row's, whose cached distance at a sink says little) run through the capture as
        the prefix, the token and a fill to ``length``; the first that reproduces the row bit for bit is recorded in
        ``seen.measured`` with that plain distance. Whether one was."""
        if not self.applies or not prefix or length <= len(prefix):
            return False
        fill = length - len(prefix) - 1
        near = dists.argsort()[:ALONE].tolist()
        if lead is not None:  # the other rule's choice first
            near = list(dict.fromkeys([*(ids == lead).nonzero().flatten().tolist(), *near]))
        for i in near:
            token = int(ids[i])
            if float(dists[i]) > radii.cached and token != lead:  # the lead's cached row may lie anywhere at a sink
                break
            distance = self._distance([*prefix, token, *[token] * fill], len(prefix), seen)
            if distance <= radii.resolution:
                seen.measured[token] = distance
                return True
        return False

    def _distance(self, sequence: list[int], t: int, seen: Verified) -> float:
        """The distance to the target of row ``t`` of ``sequence``'s capture (inf where it ships no such row)."""
        assert self.capture is not None
        rows = self.capture(sequence)
        if len(rows) != len(sequence):
            return float("inf")
        return float(self.source.distances(rows[t : t + 1].float(), seen.target)[0])
