"""Which layer of a model a states array holds, found from the states alone (no tokens, no search).

Each layer's states occupy their own region of the hidden space: the residual stream's norm and direction grow block
by block, and position 0 (an attention sink in most models) takes a layer-specific form whatever its token. A
*signature* per model and dtype, built once from one forward of sample prompts (prose from the built-in corpus and
random token ids) at every layer and cached, holds per layer the mean state at position 0 and at later positions, and
one covariance pooled over layers for each (states divided by the layer's median norm). A given array is scored
against every layer by minus twice its log-likelihood under a multivariate t with that mean and covariance (the
source's error, e.g. added noise, widens the covariance), and:

* the lowest score names the layer, *decisively* when every other layer scores at least ``MARGIN`` more; where it
  does not, position 0 may (:func:`settle`): its state depends on its token alone, so of the layers the scores cannot
  tell apart, the states' own is one where it lies within the source's bound of a token's state;
* a best layer's *spread* (the median later row's squared Mahalanobis distance per dimension) above ``FIT`` means the
  states fit no layer of this model (another model whose hidden size matches by chance, random numbers, a window
  that does not start at position 0).

It decides which layer the search runs at and refuses a given layer that decisively does not fit, within seconds and
before any search; what the search then accepts is the acceptor's business alone (:mod:`.acceptor`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..corpora import sample_prompts
from ..models import Layer, LoadedModel
from .sources import ErrorModel, Exact
from .tables import first_position_table, read_tables, write_tables

log = logging.getLogger(__name__)

KIND = "layer-signature2"  # the cache's name for the signature; a new name whenever how it is built changes
PROMPTS = 64  # sample prompts of each kind (prose, random ids): 2 x 64 x 24 rows per layer, ~3 s on SmolLM2 here
TOKENS = 24  # tokens per sample prompt
RIDGE = 1e-3  # the pooled covariances' diagonal loading, relative to their mean variance (a 576-dim estimate from
# ~4,000 rows at position 0 would otherwise be near singular in the directions no sample spans)
MARGIN = 100.0  # twice the log-likelihood ratio by which the best layer must beat every other to be called decisive:
# on SmolLM2's held-out prompts (5 texts and 8 random-id prompts at every layer, float32 and bfloat16, noise to 0.1) a
# wrong best layer never led by more than 21.6, the right one by a median of 310-612 (docs/results.md)
FIT = 6.0  # a best spread above this fits no layer: SmolLM2's held-out prompts spread 3.7 at most (float32, bfloat16,
# noise up to 0.1), Gaussian random numbers from 0.3 per coordinate up 9.9 at the least (docs/results.md; below that
# the layer-0 check refuses them: EMBEDDING); position 0's spread is
# not calibrated (its covariance is estimated from 128 rows), so states of one row per prompt are never refused on it
DOF = 8.0  # the t distribution's degrees of freedom
ROWS = 64  # rows scored at most (the first ones): enough to decide, and a constant cost for long prompts
CENTRED = 1e-3  # a row whose mean is below this fraction of its RMS is centred; a model's own rows are not (a real
# row's mean is ~1/sqrt(d) of its RMS at random, so that every one of CENTRED_ROWS rows passes by chance is ~1e-8)
CENTRED_ROWS = 4
TRIED = 3  # layers within MARGIN of the best that position 0 is checked at (a first-position table each), at most
EMBEDDING = 0.05  # layer 0 holds the tokens' embeddings: position 0 of a capture lies within rounding of one
# (bfloat16: ~4e-3 of its norm) beyond the source's bound; random numbers at the embeddings' scale fit layer 0's
# covariance (SmolLM2: N(0, 0.03) fits it at 0.43) but lie ~2.6 of their norm from every embedding


@dataclass(frozen=True)
class Signature:
    """Per layer (index = layer, ``0..L+1``) the mean state at position 0 and at later positions; each pooled
    covariance as its eigenbasis and eigenvalues."""

    first_scale: torch.Tensor  # [L + 2]: each layer's median norm
    first_mean: torch.Tensor  # [L + 2, d], of states divided by the layer's scale (all float64 in memory)
    first_basis: torch.Tensor  # [d, d]
    first_var: torch.Tensor  # [d]
    rest_scale: torch.Tensor
    rest_mean: torch.Tensor
    rest_basis: torch.Tensor
    rest_var: torch.Tensor
    centred: torch.Tensor  # [L + 2]: 1 where every sample row of the layer is centred (:func:`centred`), else 0


@dataclass(frozen=True)
class LayerFit:
    """How well states fit each layer of one model, by layer name: ``scores`` decide which layer, ``spreads`` whether
    any fits."""

    model: str
    scores: dict[str, float]  # minus twice the log-likelihood, summed over rows (lower: better)
    spreads: dict[str, float]  # the median later row's squared Mahalanobis distance per dimension (about 1: in place)
    measured: bool = True  # False: one row per prompt, whose spread is not a measure of fit (never refused on it)
    what: str = "layer"  # what the names are: layers, or a KV cache's blocks (:mod:`.blockfit`)
    chosen: str | None = None  # the layer position 0 chose among those the scores could not tell apart (:func:`settle`)

    @property
    def ranked(self) -> list[str]:
        return sorted(self.scores, key=self.scores.__getitem__)

    @property
    def best(self) -> str:
        return self.chosen or self.ranked[0]

    @property
    def fit(self) -> float:
        """The best layer's spread (about 1 for states of this model)."""
        return self.spreads[self.best]

    @property
    def fits(self) -> bool:
        return not self.measured or self.fit <= FIT

    @property
    def decisive(self) -> bool:
        """Whether the best layer beats every other by ``MARGIN``, or position 0 chose it (:func:`settle`)."""
        ranked = self.ranked
        return self.chosen is not None or len(ranked) == 1 or self.scores[ranked[1]] - self.scores[ranked[0]] >= MARGIN

    @property
    def close(self) -> list[str]:
        """The layers within ``MARGIN`` of the best score, best first."""
        return [name for name in self.ranked if self.scores[name] - self.scores[self.ranked[0]] < MARGIN]

    def rules_out(self, layer: str) -> bool:
        """Whether the states decisively do not come from ``layer``: another layer fits, and beats it by ``MARGIN``."""
        return self.fits and layer != self.best and self.scores[layer] - self.scores[self.best] >= MARGIN

    def describe(self) -> str:
        """One phrase: the best layer, its fit and the runner-up."""
        ranked = self.ranked
        text = f"{self.what} {self.best} (fit {self.fit:.3g}"
        if self.chosen is not None:
            others = ", ".join(name for name in self.close if name != self.chosen)
            return text + (
                f"; the fit alone could not tell it from {self.what} {others}: only at {self.what} {self.chosen} does "
                "every prompt's position 0 lie within the error model's bound of a token's state)"
            )
        if len(ranked) > 1:
            gap = self.scores[ranked[1]] - self.scores[ranked[0]]
            text += f"; next: {self.what} {ranked[1]}, {gap:.3g} worse"
        return text + ")"


def signature(model: LoadedModel) -> Signature:
    """The model's layer signature in its dtype (built on first use: one forward of the sample prompts at every
    layer; cached on the loaded model and on disk)."""
    return cached_signature(model, KIND, lambda: _build(model), "layer signature")


def cached_signature(model: LoadedModel, kind: str, build: Callable[[], dict], what: str) -> Signature:
    """The signature cached as ``kind`` for the model's weights and dtype (on the loaded model and on disk), made by
    ``build()`` (its tensors) on first use; ``what`` names it in the log."""
    key = (kind, model.dtype)
    if key in model.memo:
        return model.memo[key]
    anchor = model.probe.layer(0)
    stored = read_tables(model, anchor, kind)
    if stored is None:
        log.info("building the %s of %s (%s)", what, model.name, model.dtype)
        stored = build()
        write_tables(model, anchor, kind, stored)
    value = Signature(**{name: t.double() for name, t in stored.items()})
    model.memo[key] = value
    return value


def sample_ids(model: LoadedModel) -> torch.Tensor:
    """``[prompts, TOKENS]``: the signatures' sample prompts (random ids, then prose where the model has a
    tokenizer)."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.probe.vocab_size, (TOKENS,), generator=gen) for _ in range(PROMPTS)]
    if model.tokenizer is not None:
        prompts, _ = sample_prompts(model.tokenizer, "prose", PROMPTS, max_tokens=TOKENS, seed=0, min_tokens=TOKENS)
        rows += [torch.tensor(p.ids[:TOKENS]) for p in prompts if len(p.ids) >= TOKENS]
    return torch.stack(rows).clamp_(max=model.probe.vocab_size - 1)


def sample_states(model: LoadedModel, layers: list) -> dict[Layer, torch.Tensor]:
    """Each of ``layers``' states ``[prompts, TOKENS, d]`` of the sample prompts (forwards of 32 prompts at once)."""
    parts: dict[Layer, list[torch.Tensor]] = {}
    with torch.no_grad():
        for chunk in sample_ids(model).split(32):
            for layer, value in model.probe.states(chunk, layers).items():
                parts.setdefault(layer, []).append(value)
    return {layer: torch.cat(values) for layer, values in parts.items()}


def _build(model: LoadedModel) -> dict[str, torch.Tensor]:
    states = sample_states(model, [*range(model.probe.n_layers + 1), "final"])
    return statistics(torch.stack([states[layer].double().cpu() for layer in sorted(states)]))  # [L + 2, prompts, T, d]


def statistics(every: torch.Tensor) -> dict[str, torch.Tensor]:
    """A :class:`Signature`'s tensors from sample rows ``[K, prompts, T, d]`` of ``K`` layers (or blocks)."""
    out: dict[str, torch.Tensor] = {"centred": torch.tensor([float(centred(list(rows))) for rows in every])}
    for name, rows in (("first", every[:, :, 0]), ("rest", every[:, :, 1:].flatten(1, 2))):
        scale = rows.norm(dim=-1).median(dim=1).values  # [L + 2]: each layer's typical norm
        rows = rows / scale[:, None, None]
        mean = rows.mean(1)
        dev = (rows - mean[:, None]).flatten(0, 1)
        cov = dev.T @ dev / len(dev)
        cov += RIDGE * cov.diagonal().mean() * torch.eye(len(cov), dtype=cov.dtype)
        var, basis = torch.linalg.eigh(cov)
        out |= {f"{name}_scale": scale, f"{name}_mean": mean, f"{name}_basis": basis}
        out[f"{name}_var"] = var.clamp(min=1e-30)
    return {k: v.float() if k.endswith("mean") else v for k, v in out.items()}


def fit_layers(
    model: LoadedModel, states: list[torch.Tensor], source: ErrorModel | None = None, from_first: bool = True
) -> LayerFit:
    """Score every layer of ``model`` against ``states`` (each ``[T, d]``, from position 0; ``from_first=False``:
    every row as a later position). ``source`` widens the covariance by its bound's per-dimension share at each row
    (e.g. added noise)."""
    n_layers = model.probe.n_layers
    names = [Layer(i, n_layers).name for i in range(n_layers + 2)]
    return score(signature(model), names, states, source, model.name, from_first=from_first)


def score(
    sig: Signature,
    names: list[str],
    states: list[torch.Tensor],
    source: ErrorModel | None,
    model: str,
    what: str = "layer",
    from_first: bool = True,
) -> LayerFit:
    """:func:`fit_layers` against any signature whose entries are ``names`` (layers, or a KV cache's blocks);
    ``from_first=False``: every row scored as a later position (rows that may not start at position 0)."""
    source = source or Exact()
    total = torch.zeros(len(names), dtype=torch.float64)
    spreads: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for prompt in states:
        x = prompt[:ROWS].detach().cpu().double()
        split = 1 if from_first else 0
        for start, part, scale, mean, basis, var in (
            (0, x[:split], sig.first_scale, sig.first_mean, sig.first_basis, sig.first_var),
            (1, x[split:], sig.rest_scale, sig.rest_mean, sig.rest_basis, sig.rest_var),
        ):
            if not len(part):
                continue
            extra = torch.tensor(
                [(source.bound(row, start + i) / math.sqrt(row.numel())) ** 2 for i, row in enumerate(part)],
                dtype=torch.float64,
            )
            d = part.shape[1]
            z = (part[None] / scale[:, None, None] - mean[:, None]) @ basis  # [L + 2, rows, d]
            # each layer's covariance in the states' own units, widened by the source's error: s^2 var + extra
            spread = scale[:, None, None] ** 2 * var + extra[None, :, None]  # [L + 2, rows, d]
            m2 = (z.square() * scale[:, None, None] ** 2 / spread).sum(-1)  # [L + 2, rows]
            # minus twice the log density of a multivariate t (DOF degrees of freedom: a row far from every layer
            # weighs in logarithmically), up to what is the same for every layer
            total += ((DOF + d) * torch.log1p(m2 / DOF) + spread.log().sum(-1)).sum(1)
            spreads[start].append(m2 / d)
    later = bool(spreads[1])  # later positions' spread is the calibrated measure of fit; position 0's is not
    spread = torch.cat(spreads[1] if later else spreads[0], 1).median(1).values
    return LayerFit(
        model,
        dict(zip(names, total.tolist(), strict=True)),
        dict(zip(names, spread.tolist(), strict=True)),
        measured=later,
        what=what,
    )


def centred(states: list[torch.Tensor]) -> bool:
    """Whether every row's mean over the hidden dimensions is ~0 (``CENTRED``), over ``CENTRED_ROWS`` rows at least:
    states with the residual's mean removed, as TransformerLens' compatibility mode computes them for models with
    LayerNorm (for RMSNorm models it folds weights only: the states differ by rounding, about 1e-6 of their norm)."""
    rows = torch.cat([s.detach().double().reshape(-1, s.shape[-1]) for s in states])
    if len(rows) < CENTRED_ROWS:
        return False
    rms = rows.square().mean(-1).sqrt()
    return bool((rows.mean(-1).abs() <= CENTRED * rms).all() and (rms > 0).all())


def embedding_gap(model: LoadedModel, states: list[torch.Tensor], source: ErrorModel) -> float:
    """How far beyond the source's bound position 0 lies from the nearest token's layer-0 state (median over the
    prompts), relative to its norm."""
    return float(torch.tensor(_first_gaps(model, states, model.probe.layer(0), source)).median())


def _first_gaps(model: LoadedModel, states: list[torch.Tensor], layer: Layer, source: ErrorModel) -> list[float]:
    """Per prompt, how far beyond the source's bound its position-0 row lies from the nearest token's state at
    ``layer`` (the first-position table: built once per layer and kept), relative to the row's norm; 0 within it."""
    table = first_position_table(model, layer, progress=False)
    gaps = []
    for prompt in states:
        row = prompt[0].detach().to(table.device, torch.float32)
        nearest = ((table - row) ** 2).sum(-1).min().sqrt()
        gaps.append(max(0.0, float(nearest) - source.bound(row, 0)) / max(float(row.norm()), 1e-30))
    return gaps


def settle(model: LoadedModel, states: list[torch.Tensor], fit: LayerFit, source: ErrorModel | None = None) -> LayerFit:
    """``fit``, or where it is not decisive but fits, the same with one layer ``chosen`` by position 0: among the
    layers within ``MARGIN`` of the best (at most ``TRIED``), the only one where every prompt's position-0 row lies
    within ``source``'s bound of some token's state. Position 0's state depends on its token alone, so the states' own
    layer is one such wherever the bound holds; where another is too, or none is, nothing is chosen. This chooses
    where the search runs; every token's verdict is still the acceptor's."""
    if fit.decisive or not fit.fits:
        return fit
    close = fit.close
    if len(close) > TRIED:
        return fit
    source = source or Exact()
    within = [name for name in close if not any(_first_gaps(model, states, model.probe.layer(name), source))]
    log.info("layer fit not decisive among %s; position 0 within the bound at %s", close, within)
    return replace(fit, chosen=within[0]) if len(within) == 1 else fit
