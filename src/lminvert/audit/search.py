"""Inversion of rows that are a known function of each position's state (a KV cache, a public projection, states
with positions missing): SIPIT with the comparison made in the rows' space.

For each position, the candidates' states are computed over the recovered prefix's KV cache
(:meth:`lminvert.models.LayerProbe.continuation`), turned into rows by the leak (and the public map, if any), and their
L2 distances to the observed row are the evidence; :func:`lminvert.invert.acceptor.decide` alone gives the token and
its verdict. Every distance is measured by the cached forward, with its rounding inside the radii (no plain
forwards: the shipped rows never reproduce bit for bit, so nothing is gained by them). Candidates come from rankers:
position 0 from the first-position table (every token's state alone, so every token is verified at once), later
positions first the model's own next-token prediction from the prefix (for a states leak, alternately with what the
row itself reads as: :class:`StateReading`), then a ridge fit from the verified candidates' input vectors to their
rows, re-fitted after each batch (at position 1 of a states leak, alternately with the position-1 map). Where several
first tokens fit position 0's row (an attention sink's norm lets noise or quantisation cover the gaps between them)
or none does, the next row chooses among the nearest (``lookahead``), as a guess. A position whose row is missing gets
the prediction's first token under which the next position's row finds the nearest candidate, as a guess (uncertain,
and so is everything after it).

A :class:`StateMemo` shared by the searches of one leak and layer keeps every verified candidate's state by its
prefix, so another defence's search over the same prompt verifies a candidate one of them already ran without a
forward (``RowSearch(memo=None)``: none).

Radii are measured, not assumed (:func:`measure`): on calibration prompts, how far the cached forward's rows lie from a
plain forward's (rounding) and how far the deployment's own rows lie from the plain forward's (where they were
computed); the source's error model adds the defence's bound, computed on the shipped row.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..invert import acceptor
from ..invert.acceptor import Evidence, Radii
from ..invert.proposal import merge
from ..invert.reader import reading_for
from ..invert.reading import nearest_inputs, read
from ..invert.sources import ErrorModel
from ..invert.tables import first_position_table, position1_projection
from ..invert.tolerance import FLOOR, SAFETY, calibration_prompts, norm
from ..models import LoadedModel, Prefix
from ..models.ties import tied_token_groups
from .memo import StateMemo

BATCH = 256  # candidates verified per forward
GUESSES = 8  # tokens tried at a missing position (the prediction's first ones)
LOOK = 8  # first tokens (the nearest at position 0) under which the next token is sought where several fit there
FIT = 512  # verified candidates the ridge fit uses (the closest to the target)
RIDGE = 1e-2  # the ridge fit's penalty, relative to the mean squared norm of the centred input vectors

Rows = Callable[[torch.Tensor, int], torch.Tensor]  # states [n, d] at a position -> rows [n, k] as shipped


@dataclass(frozen=True)
class Measured:
    """Relative disagreements in the rows' space (see the module docstring)."""

    rounding: float  # cached forward vs plain forward
    first: float  # the deployment's rows vs the plain forward's, at position 0
    rest: float  # the same at later positions


@dataclass(frozen=True)
class Found:
    token_ids: list[int]
    verdicts: list[str]
    checked: list[int]  # candidates verified per position
    half_gaps: list[float | None]  # half the distance from the chosen row to the nearest other verified row
    seconds: float


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def measure(model: LoadedModel, layer, rows_of: Rows, capture: Callable[[list[int]], torch.Tensor]) -> Measured:
    """The disagreements on two calibration prompts of 12 tokens (every position measured)."""
    probe = model.probe
    rounding, first, rest = 0.0, 0.0, 0.0
    for ids in calibration_prompts(model, n=2, length=12):
        observed = capture(ids)
        plain = probe.states(torch.tensor(ids), [layer])[layer][0]
        for t in range(len(ids)):
            row = rows_of(plain[t : t + 1], t)
            cached = rows_of(probe.continuation(probe.prefix(ids[:t], layer), torch.tensor([ids[t]])), t)
            rounding = max(rounding, _relative(cached, row))
            if t == 0:
                first = max(first, _relative(observed[:1], row))
            else:
                rest = max(rest, _relative(observed[t : t + 1], row))
    return Measured(rounding, first, rest)


class _Ridge:
    """Rows predicted from input vectors by a ridge fit on the verified candidates (dual form: fewer samples than
    dimensions), and the vocabulary ordered by how near its predicted rows lie to the target."""

    def __init__(self, vocab: torch.Tensor) -> None:
        self.vocab = vocab  # [V, d] float32

    def order(self, ids: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Every token, the nearest predicted row first. The prediction of input ``v`` is ``v W + b`` with
        ``W = X^T alpha`` (``X`` the centred inputs of the ``n`` samples): it lies in the span of ``alpha``'s rows, so
        its distance to the target is, up to a constant, its distance there. Measured in an orthonormal basis ``U`` of
        that span (``n`` dimensions, not the rows' ``k``), the vocabulary's product costs ``V x d x n``, not
        ``V x d x k``, and the order is the same (up to float32 rounding)."""
        nearest = (rows.double() - target.double()).norm(dim=1).argsort()[:FIT]  # a local fit: the closest ones
        ids, rows = ids[nearest], rows[nearest]
        x = self.vocab[ids].double()
        mean_x, mean_y = x.mean(0), rows.double().mean(0)
        x = x - mean_x
        gram = x @ x.T
        penalty = RIDGE * float(gram.diagonal().mean()) + 1e-12
        alpha = torch.linalg.solve(gram + penalty * torch.eye(len(x), dtype=torch.float64), rows.double() - mean_y)
        weights = x.T @ alpha  # [d, k]
        offset = mean_y - mean_x @ weights - target.double()
        if len(alpha) < alpha.shape[1]:  # fewer samples than the rows' dimensions: measure in alpha's row span
            basis = torch.linalg.qr(alpha.T).Q  # [k, n]
            weights, offset = weights @ basis, offset @ basis
        # the prediction itself in float32: it only orders candidates
        return (self.vocab @ weights.float() + offset.float()).norm(dim=1).argsort()


class RowSearch:
    """One prompt's inversion from rows (see the module docstring)."""

    def __init__(
        self, model: LoadedModel, layer, rows_of: Rows, source: ErrorModel, measured: Measured,
        table: torch.Tensor | None = None, memo: StateMemo | None = None, reading: StateReading | None = None,
        lookahead: bool = True,
    ) -> None:  # fmt: skip
        """``table``: every token's row at position 0 ``[V, k]`` (computed from the first-position table when not
        given); ``memo``: states kept across searches at this layer (None: every candidate is run through the model);
        ``reading``: what shipped states read as (:class:`StateReading`, a states leak only; None: the first batch is
        the model's prediction alone, later ones the ridge fit's); ``lookahead``: where several first tokens fit, the
        next row chooses among them (False: the nearest at position 0)."""
        if memo is not None and (memo.probe is not model.probe or memo.layer != layer):
            raise ValueError("the memo holds another model's or another layer's states")
        self.model, self.layer, self.rows_of, self.memo = model, layer, rows_of, memo
        self.reading, self.lookahead = reading, lookahead
        self.source = source.calibrated(measured.first, measured.rest)
        self.rounding = measured.rounding
        probe = model.probe
        # a half-precision model's cached forward need not round as the observer's whole forward does, even where the
        # calibration prompts found them equal: the rounding radius never falls below one unit of its precision
        self.floor = max(FLOOR, float(torch.finfo(probe.dtype).eps))
        self.ridge = _Ridge(probe.vocab_matrix(torch.float32).cpu())
        if table is None:
            table = rows_of(first_position_table(model, layer, progress=False).float(), 0)
        self.table = table
        self.twins = {t: tuple(x for x in g if x != t) for g in tied_token_groups(model) for t in g}

    def radii(self, shipped: torch.Tensor, t: int) -> Radii:
        """Every distance here is a cached forward's, so (as in :mod:`lminvert.invert.reference`, whose distances are
        all plain) the plain radius is the cached one: the error bound plus the cached forward's rounding."""
        bound = self.source.bound(shipped, t)
        size = norm(shipped)
        rounding = SAFETY * max(self.rounding, self.floor) * size
        return Radii(bound + rounding, bound + rounding, bound, rounding, 0.0, FLOOR * size)

    def run(self, shipped: torch.Tensor) -> Found:
        """Invert one prompt's rows ``[T, k]`` (rows of NaN: missing positions)."""
        start = time.perf_counter()
        ids: list[int] = []
        verdicts: list[str] = []
        checked: list[int] = []
        gaps: list[float | None] = []
        after_guess = fitted = False
        reads = self.reading.orders(shipped) if self.reading is not None else [None] * len(shipped)
        for t, row in enumerate(shipped.float()):
            after = shipped[t + 1].float() if t + 1 < len(shipped) else None
            if torch.isnan(row).any():
                decision, count, gap = self._missing(ids, after), 0, None
            else:
                decision, count, gap = self._position(ids, row, t, fitted, reads[t])
            if t == 0 and decision.guess and self.lookahead and after is not None and not torch.isnan(after).any():
                token, looked = self._first_by_next(row, after, reads[1])
                decision, count = acceptor.chosen_by_next(token), count + looked
            assert decision.token is not None
            verdict = acceptor.final_verdict(decision, tied=decision.token in self.twins, after_guess=after_guess)
            after_guess = after_guess or decision.guess
            # after a guess, later positions fit only if it was right: they are not searched through the vocabulary
            fitted = (fitted and not decision.guess) or verdict != acceptor.UNCERTAIN
            ids.append(decision.token)
            verdicts.append(verdict)
            checked.append(count)
            gaps.append(gap)
        return Found(ids, verdicts, checked, gaps, time.perf_counter() - start)

    def _prediction(self, prefix: list[int]) -> torch.Tensor:
        """Every token, most likely next first (the model's own prediction from the recovered prefix)."""
        if self.memo is not None:
            return self.memo.prediction(prefix, lambda: self._predict(prefix))
        return self._predict(prefix)

    def _predict(self, prefix: list[int]) -> torch.Tensor:
        probe = self.model.probe
        bos = getattr(self.model.tokenizer, "bos_token_id", None) if self.model.tokenizer is not None else None
        context = prefix or ([] if bos is None else [bos])
        if not context:
            return torch.arange(probe.vocab_size)
        with torch.no_grad():
            ids = torch.tensor([context], device=probe.device)
            logits = self.model.model(input_ids=ids, logits_to_keep=1).logits[0, -1]
        return logits.float().cpu().argsort(descending=True)

    def _ranked(self, prefix: list[int], reading: torch.Tensor | None) -> torch.Tensor:
        """Every token, the first batch alternately from the row's reading and the model's prediction (the
        prediction alone without a reading), then the prediction's order."""
        predicted = self._prediction(prefix)
        if reading is None:
            return predicted
        return torch.cat([merge(torch.stack([reading[:BATCH], predicted[:BATCH]])), predicted])

    def _first_by_next(self, first: torch.Tensor, after: torch.Tensor, reading) -> tuple[int, int]:
        """Position 0's token where several fit its row (an attention sink's huge norm lets noise or quantisation
        cover the gaps between first tokens) or none does, and the candidates this ran. Given each of the nearest
        first tokens at position 0 in turn (``LOOK`` at most), the next token is found, then first tokens are tried
        under it (:meth:`_firsts_under`) until the acceptor finds any under which the next row's state fits (several
        may: another next token would not separate them either); else the first try's choice. A guess all the same
        (the next token was found given another first one)."""
        order = (self.table.double() - first.double()).norm(dim=1).argsort()
        ran, picks = 0, []
        for guess in order[:LOOK].tolist():
            following, count, _ = self._position([guess], after, 1, False, reading)
            assert following.token is not None
            pick, tried = self._firsts_under(following.token, order, after)
            ran += count + tried
            picks.append(pick)
            if not pick.unfitted:
                break
        token = (picks[0] if picks[-1].unfitted else picks[-1]).token
        assert token is not None
        return token, ran

    def _firsts_under(self, following: int, order: torch.Tensor, after: torch.Tensor) -> tuple[acceptor.Decision, int]:
        """The acceptor's choice of a first token by the next row, the next token being ``following``: first tokens
        in ``order``, then by a ridge fit of the next row on their input vectors, a batch of two-token forwards at a
        time; and the first tokens tried."""
        radii, probe = self.radii(after, 1), self.model.probe
        done = torch.zeros(len(order), dtype=torch.bool)
        seen = _Verified(after)
        while True:
            batch = order[~done[order]][:BATCH]
            done[batch] = True
            pairs = torch.stack([batch, torch.full_like(batch, following)], 1).to(probe.device)
            with torch.no_grad():
                rows = self.rows_of(probe.states(pairs, [self.layer])[self.layer][:, 1], 1)
            ids, rows, dists = seen.add(batch, rows)
            spent = bool(done.all())
            evidence = Evidence(
                ids, dists, rows, after, seen.measured, radii.cached, False,
                exhausted=spent, swept=spent, checked=len(ids), twins=self.twins,
            )  # fmt: skip
            decision = acceptor.decide(evidence, radii)
            if decision.final:
                return decision, len(ids)
            order = self.ridge.order(ids, rows, after)

    def _missing(self, prefix: list[int], after: torch.Tensor | None) -> acceptor.Decision:
        """A missing position: of the prediction's first ``GUESSES`` tokens, the one under which the next position's
        row (if shipped) has the nearest candidate among the prediction's first batch there."""
        guesses = self._prediction(prefix)[:GUESSES]
        if after is not None and not torch.isnan(after).any():
            nearest = []
            for g in guesses.tolist():
                grown = [*prefix, g]
                rows = self._verify(grown, self._prediction(grown)[:BATCH])
                nearest.append(float((rows.double() - after.double()).norm(dim=1).min()))
            guesses = guesses[torch.tensor(nearest).argsort()]
        guess = guesses[:1]
        empty = torch.empty(0)
        evidence = Evidence(guess, torch.full((1,), math.inf), empty, empty, {}, 0.0, False, exhausted=True)
        return acceptor.decide(evidence, Radii(0.0, 0.0, 0.0, 0.0, 0.0, 0.0))

    def _verify(
        self, prefix_ids: list[int], ids: torch.Tensor, prefix: Callable[[], Prefix] | None = None
    ) -> torch.Tensor:
        """The rows of candidates ``ids`` at the position after ``prefix_ids`` (``prefix()``: the probe's prefix,
        made only where a candidate is run through the model)."""
        probe, t = self.model.probe, len(prefix_ids)
        if t == 0:
            return self.table[ids]
        made = prefix or (lambda: probe.prefix(prefix_ids, self.layer))
        if self.memo is not None:
            return self.rows_of(self.memo.states(prefix_ids, ids, made), t)
        with torch.no_grad():
            return self.rows_of(probe.continuation(made(), ids.to(probe.device)), t)

    def _position(
        self, prefix_ids: list[int], target: torch.Tensor, t: int, fitted: bool, reading: torch.Tensor | None = None
    ) -> tuple[acceptor.Decision, int, float | None]:
        probe = self.model.probe
        radii = self.radii(target, t)
        vocab = probe.vocab_size
        prefix = functools.cache(lambda: probe.prefix(prefix_ids, self.layer))  # made once, where first needed
        order = torch.arange(vocab) if t == 0 else self._ranked(prefix_ids, reading)
        done = torch.zeros(vocab, dtype=torch.bool)
        seen = _Verified(target)
        while True:
            batch = order[~done[order]][: vocab if t == 0 else BATCH]
            done[batch] = True
            ids, rows, dists = seen.add(batch, self._verify(prefix_ids, batch, prefix))
            spent = bool(done.all())
            evidence = Evidence(
                ids, dists, rows, target, seen.measured, radii.cached, False,
                exhausted=spent, swept=spent, checked=len(ids), fitted=fitted, twins=self.twins,
            )  # fmt: skip
            decision = acceptor.decide(evidence, radii)
            if decision.final:
                return decision, len(ids), _half_gap(ids, rows, decision.token)
            order = self.ridge.order(ids, rows, target)
            if t == 1 and self.reading is not None:
                order = merge(torch.stack([self.reading.second(ids, rows, target), order]))


class _Verified:
    """The candidates verified at one position so far: ids, rows, distances to ``target`` (every one measured with the
    rounding inside the radii, also by id in ``measured``)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target.double()
        self.ids: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.measured: dict[int, float] = {}

    def add(self, batch: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add a batch's rows; every candidate verified so far: ``(ids, rows, distances)``."""
        dists = (rows.double() - self.target).norm(dim=1)
        self.measured.update(zip(batch.tolist(), dists.tolist(), strict=True))
        self.ids.append(batch)
        self.rows.append(rows)
        self.dists.append(dists)
        return torch.cat(self.ids), torch.cat(self.rows), torch.cat(self.dists)


def _half_gap(ids: torch.Tensor, rows: torch.Tensor, token: int) -> float | None:
    chosen = (ids == token).nonzero().flatten()
    if len(ids) < 2 or not len(chosen):
        return None
    others = torch.cat([rows[: chosen[0]], rows[chosen[0] + 1 :]])
    gap = float((others - rows[chosen[0]]).norm(dim=1).min()) / 2
    return gap if math.isfinite(gap) else None


class StateReading:
    """What shipped rows of states at ``layer`` read as, for the rows search of a states leak (proposals only: every
    candidate is still verified):

    * :meth:`orders` - per position, the ``BATCH`` tokens whose input vectors lie nearest what the row (and the one
      before it) reads as (:mod:`lminvert.invert.reading`: the reading network where one is cached, else the linear
      reading map, built and cached on first use);
    * :meth:`second` - at position 1, every token by the position-1 map ``h ~ a + e_v J``
      (:func:`lminvert.invert.tables.position1_projection`), the offset ``a`` from the verified candidates: the
      reading and the model's prediction after one token are weakest there."""

    def __init__(self, model: LoadedModel, layer) -> None:
        self.model, self.layer = model, layer
        self.weights = reading_for(model, layer)

    def orders(self, rows: torch.Tensor) -> list[torch.Tensor | None]:
        """Per position of ``rows`` ``[T, d]``, the reading's first tokens (None at position 0, whose table verifies
        every token, and where the row or the one before it is missing)."""
        rows = rows.float()
        present = ~torch.isnan(rows).any(dim=1)
        usable = [t for t in range(1, len(rows)) if present[t] and present[t - 1]]
        out: list[torch.Tensor | None] = [None] * len(rows)
        if usable:
            predicted = read(self.weights, rows.nan_to_num().to(self.model.probe.device))[usable]
            for t, order in zip(usable, nearest_inputs(self.model, predicted, BATCH).cpu(), strict=True):
                out[t] = order
        return out

    def second(self, ids: torch.Tensor, states: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Every token at position 1, nearest first, by the position-1 map with its offset measured on the verified
        candidates ``ids`` and their states (attention sinks, norms 4x the median and more, left out)."""
        jac, norms = position1_projection(self.model, self.layer)
        jac, norms = jac.float().cpu(), norms.float().cpu()
        vocab = self.model.probe.vocab_matrix(torch.float32).cpu()
        size = states.norm(dim=1)
        keep = size <= 4 * size.median()
        offset = (states[keep].float() - vocab[ids[keep]] @ jac).mean(0)
        return (norms - 2 * vocab @ (jac @ (target.float() - offset))).argsort()
