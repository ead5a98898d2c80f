"""The rows search's rankers beyond the model's own prediction (proposals only: every candidate they propose is
verified, :mod:`.search`): :class:`Secant`, the engine's secant model of the position's map, carried from position
to position; :class:`Ridge`, rows predicted from input vectors by a local fit on this position's verified candidates
alone; and :class:`StateReading`, what shipped states read as.
"""

from __future__ import annotations

import torch

from ...forward import prompt_states
from ...models import Layer, LayerProbe, LoadedModel
from ..context import PositionContext
from ..linear import FUSED
from ..proposal import fuse, merge, ranked, reading_log_probs
from ..rankers import SecantRanker
from ..reader import reading_for
from ..reading import input_distances, read
from ..tables import Through, first_position_table, position1_projection
from ..tolerance import calibration_prompts
from ..views import View
from .back import back_map, read_back

FIT = 512  # verified candidates the ridge fit uses (the closest to the target)
RIDGE = 1e-2  # the ridge fit's penalty, relative to the mean squared norm of the centred input vectors
VIEW_PRIOR = True  # a view's secant model starts from the position-1 map fitted through the view (False: no first fit)
READ_BACK = True  # a KV cache's rows are read back as states for the reading (:mod:`.back`; False: not read)
# the reading and the model's prediction also ranked as a product of experts (:func:`lminvert.invert.proposal.fuse`,
# weight :data:`lminvert.invert.linear.FUSED`), as the engine's proposal ranks, that order alternating with theirs
# (RowSearch._ranked); False: the two alternate alone
FUSE = True
# a KV cache's next-token prediction read from its rows (StateReading.priors: the rows read back, through the blocks
# above, once per prompt), not from the recovered prefix (False: the blocks above run for every token chosen); where
# no row is missing and ABOVE or more of the states layer's blocks lie above it
ROWS_PRIOR = True
ABOVE = 8


class Secant:
    """The engine's secant model ``h(x) ~ a + x J`` of a position's map from input vectors to rows
    (:class:`lminvert.invert.rankers.SecantRanker`, the linear policy's: fitted on this position's verified candidates
    and the last positions', pulled towards the previous fit, refitted whenever the position's candidates doubled; for
    the rows of a states leak it starts from the position-1 map, for a view's rows from that map fitted through the
    view), for one prompt at a time. Where neither the model's
    prediction nor the reading ranks a token, it often does: SmolLM2 layer 30, ``noise:0.001``, two positions whose
    token stood at 3,576 and 25,074 in the ridge fit's order stood at 9 and 1,032 in this one."""

    def __init__(self, model: LoadedModel, layer, states: bool, through: Through | None = None) -> None:
        """``states``: the rows are the layer's states themselves (the position-1 map is then the first fit);
        ``through``: else a view's rows (``(name, rows_of)``; a ``ValueError`` with ``states``), whose position-1 map
        (:func:`lminvert.invert.tables.second_position_map` through it) is the first fit where :data:`VIEW_PRIOR` is
        on. A KV cache's position 1 after its attention sink: the model's prediction put the true token of 8 held-out
        prompts 33rd to 42,170th at block 15, this map (its offset from 32 verified rows) 1st to 569th for 6 of them."""
        if states and through is not None:
            raise ValueError("a secant model fits the layer's states or a view's rows, not both")
        self.probe = model.probe
        self.ranker = SecantRanker()
        self.ranker.prepare(model, layer, states, None)
        if through is not None and VIEW_PRIOR:
            self.ranker.start_from(position1_projection(model, layer, through))
        self.ctx: PositionContext  # the position being searched (set by :meth:`begin`)

    def begin_prompt(self) -> None:
        self.ranker.begin_prompt(torch.empty(0), None)

    def begin(self, t: int, target: torch.Tensor) -> None:
        """Position ``t`` starts, its row ``target`` (the ranker sees its verified candidates from now on)."""
        target = target.float().to(self.probe.device)
        self.ctx = PositionContext(self.probe, None, 0, target, 0.0, t, torch.Generator())  # type: ignore[arg-type]
        self.ranker.begin_position(self.ctx)

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """A batch verified at the position: ``ids`` and their ``rows``."""
        device = self.probe.device
        ids, rows = ids.to(device), rows.float().to(device)
        self.ctx.record(ids, rows, self.ctx.distances(rows))

    def order(self) -> torch.Tensor | None:
        """Every token, nearest predicted row first (None: no fit yet)."""
        if self.ranker.refit_due(self.ctx):
            self.ranker.fit(self.ctx)
        scores = self.ranker.scores(self.ctx)
        return None if scores is None else ranked(scores.cpu())

    def end(self) -> None:
        """The position is decided: its pairs join the next positions' fits."""
        self.ranker.end_position(self.ctx)


def typical_norm(model: LoadedModel, layer: Layer) -> float:
    """The median norm of ``layer``'s states after position 0 on the calibration prompts
    (:func:`lminvert.invert.tolerance.calibration_prompts`; SmolLM2: within 5% of 16 held-out prompts' at layers 1, 14
    and 29), kept on the loaded model."""
    key = ("typical-norm", layer)
    if key not in model.memo:
        found = prompt_states(model, calibration_prompts(model), [layer], progress=False)
        model.memo[key] = float(torch.cat([s[layer][1:].float().norm(dim=1) for s in found]).median())
    return model.memo[key]


class Ridge:
    """Rows predicted from input vectors by a ridge fit on the verified candidates (dual form: fewer samples than
    dimensions), and the vocabulary ordered by how near its predicted rows lie to the target."""

    def __init__(self, vocab: torch.Tensor, low: torch.Tensor | None = None, strongest: int | None = None) -> None:
        self.vocab = vocab  # [V, d] float32
        self.low = low  # the same in bfloat16 for the prediction's product, or None (float32): it only orders
        self.strongest = strongest  # the distances measured along this many strongest directions (None: all)

    @classmethod
    def of(cls, probe: LayerProbe, strongest: int | None = None) -> Ridge:
        """The ridge ranker of ``probe``'s vocabulary, on the CPU, its product on the probe's kept bfloat16 copy where
        those GEMMs are native there (:meth:`LayerProbe.low_vocab`); ``strongest``: as :class:`Ridge` takes it."""
        return cls(probe.vocab_matrix(torch.float32).cpu(), probe.low_vocab(torch.device("cpu")), strongest)

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
        if self.strongest is not None and weights.shape[1] > self.strongest:  # where the prediction varies most
            top = torch.linalg.eigh((weights.T @ weights).float()).eigenvectors[:, -self.strongest :].double()
            weights, offset = weights @ top, offset @ top
        # the prediction in float32, its product in bfloat16 where native (low_vocab): it only orders candidates
        if self.low is not None:
            return ranked(((self.low @ weights.bfloat16()).float() + offset.float()).norm(dim=1))
        return ranked((self.vocab @ weights.float() + offset.float()).norm(dim=1))


class StateReading:
    """What shipped rows of states at ``layer`` (or a view's rows read back as them) read as, for the rows search
    (proposals only: every candidate is still verified): :meth:`scores`, per position, how near each token's input
    vector lies to what the row (and the one before it) reads as (:mod:`lminvert.invert.reading`: the reading network
    where one is cached, else the linear reading map, built and cached on first use)."""

    def __init__(self, model: LoadedModel, layer, view: View | None = None) -> None:
        """``view``: the rows are that view's, read back as the states they came from (:mod:`.back`) before they are
        read (None: the rows are the layer's states)."""
        self.model, self.layer, self.view = model, layer, view
        if view is not None:  # first: where neither is kept, one forward of the training prompts builds both
            back_map(view)
        self.weights = reading_for(model, layer)

    @classmethod
    def of(cls, model: LoadedModel, view: View) -> StateReading | None:
        """The reading of ``view``'s rows: a states view's own; a KV cache's read back as states where
        :data:`READ_BACK` is on (SmolLM2, 6 held-out prompts: block 30's cache in 0.67-0.75x the time, block 15's
        in 0.98-1.11x, docs/results.md); None for any other view, and for block 1's cache, whose rows the table
        ranks."""
        if view.name == "states":
            return cls(model, view.states_layer)
        if view.name == "kv" and READ_BACK and not view.alone:
            return cls(model, view.states_layer, view)
        return None

    def scores(self, rows: torch.Tensor) -> list[torch.Tensor | None]:
        """Per position of ``rows`` ``[T, d]``, the reading's log-probabilities of every token ``[V]`` (float32, on
        the CPU; :func:`lminvert.invert.proposal.reading_log_probs`: the nearest input vector to what the row, and the
        one before it, reads as, likeliest), for the rows search to rank with; None at position 0, whose table verifies
        every token, and where the row or the one before it is missing."""
        rows = rows.float()
        present = ~torch.isnan(rows).any(dim=1)
        usable = [t for t in range(1, len(rows)) if present[t] and present[t - 1]]
        out: list[torch.Tensor | None] = [None] * len(rows)
        if usable:
            states = rows.nan_to_num() if self.view is None else read_back(self.view, rows.nan_to_num())
            predicted = read(self.weights, states.to(self.model.probe.device))[usable]
            for t, scores in zip(usable, reading_log_probs(input_distances(self.model, predicted)).cpu(), strict=True):
                out[t] = scores
        return out

    def predicts(self, rows: torch.Tensor) -> bool:
        """Whether :meth:`priors` serves ``rows`` ``[T, k]``: a KV cache's read back (:data:`ROWS_PRIOR` on), none
        missing, ``ABOVE`` blocks or more above the layer."""
        probe = self.model.probe
        above = probe.n_layers - int(self.layer)
        return self.view is not None and ROWS_PRIOR and above >= ABOVE and not bool(torch.isnan(rows).any())

    def priors(self, rows: torch.Tensor, first: int) -> list[torch.Tensor | None]:
        """Per position ``t`` of ``rows`` ``[T, k]`` (a KV cache's), the model's log-probabilities of every next token
        ``[V]`` (float32, CPU) after positions ``0 .. t - 1`` as the rows read back say they were (a proposal, as the
        engine's prior from observed states, :class:`lminvert.invert.proposal.NextTokenPrior`): their unit states
        (:func:`.back.read_back`) at the layer's typical norm (:func:`typical_norm`; the rows, RMS-normalised, do not
        keep it), position 0's the first-position table's state of ``first``, through the blocks above in one forward;
        None at position 0. SmolLM2, 16 held-out prompts, fused with the reading as :meth:`ranked` does: the true token
        among the first 16 at 194 of 304 positions at block 15 (the recovered prefix's prediction: 206), 256 at block
        30 (270), 256 at block 5 (254)."""
        probe = self.model.probe
        states = read_back(self.view, rows.float()) * typical_norm(self.model, self.layer)
        states[0] = first_position_table(self.model, self.layer, progress=False)[first].float().cpu()
        with torch.no_grad():
            last = probe.final_from(states[None].to(probe.device), self.layer)[0, :-1]
            logits = probe.next_token_logits(last, normed=True).float().log_softmax(-1).cpu()
        return [None, *logits]

    def ranked(self, prior: torch.Tensor, reading: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """Every token, by the model's prediction (``prior``, its log-probabilities) and a position's reading (its
        :meth:`scores`): alternately from each; where :data:`FUSE` is on, that order alternately with the two fused as a
        product of experts (weight :data:`lminvert.invert.linear.FUSED`; the engine's proposal's third source,
        :func:`lminvert.invert.proposal.fuse`), which ranks best but buries a token where one of the two is surely
        wrong (the alternation keeps a token within twice its place in the alternate order). SmolLM2, the KV caches
        of 24 held-out prompts read back (``benchmarks/heldout.py``): the true token among the first 32 at 339 of 456
        positions with it at block 15, 313 without; at block 30, 416 against 401. ``top``: the first ``top`` of that
        order only (an alternation's first ``n`` come from its sources' first ``n``: each source's partial sort)."""
        by_prior = ranked(prior, descending=True, top=top)
        both = merge(torch.stack([ranked(reading, descending=True, top=top), by_prior]))
        if not FUSE:
            return both
        return merge(torch.stack([ranked(fuse(prior, reading, FUSED), descending=True, top=top), both]))
