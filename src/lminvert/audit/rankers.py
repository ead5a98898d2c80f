"""The rows search's rankers beyond the model's own prediction (proposals only: every candidate they propose is
verified, :mod:`.search`): :class:`Ridge`, rows predicted from input vectors by a fit on the candidates verified so
far, and :class:`StateReading`, what shipped states read as.
"""

from __future__ import annotations

import torch

from ..invert.reader import reading_for
from ..invert.reading import nearest_inputs, read
from ..invert.tables import position1_projection
from ..models import LoadedModel

FIT = 512  # verified candidates the ridge fit uses (the closest to the target)
RIDGE = 1e-2  # the ridge fit's penalty, relative to the mean squared norm of the centred input vectors


class Ridge:
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


class StateReading:
    """What shipped rows of states at ``layer`` read as, for the rows search of a states leak (proposals only: every
    candidate is still verified):

    * :meth:`orders` - per position, the ``depth`` tokens whose input vectors lie nearest what the row (and the one
      before it) reads as (:mod:`lminvert.invert.reading`: the reading network where one is cached, else the linear
      reading map, built and cached on first use);
    * :meth:`second` - at position 1, every token by the position-1 map ``h ~ a + e_v J``
      (:func:`lminvert.invert.tables.position1_projection`), the offset ``a`` from the verified candidates: the
      reading and the model's prediction after one token are weakest there."""

    def __init__(self, model: LoadedModel, layer, depth: int) -> None:
        self.model, self.layer, self.depth = model, layer, depth
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
            for t, order in zip(usable, nearest_inputs(self.model, predicted, self.depth).cpu(), strict=True):
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
