"""One vector after the first block: the prompt's tokens read from its attention's mixture of value vectors.

After one block, a prompt's last state is ``h = x + mlp(norm2(x))`` with ``x = e_T + o_proj(z)``: the last token's
embedding plus, for every head, a convex combination (the attention weights) of the value vectors
``v_proj(norm1(e_t))`` of the prompt's tokens. Values do not depend on position (the rotary embedding turns queries
and keys only), so:

1. **The residual** ``x`` is found from ``h`` by Levenberg-Marquardt in float64 (:func:`_preimage`), from the
   residuals of the last token after a few contexts; the one whose tokens fit best (step 2) is kept. The MLP's
   landscape has many local minima: a round's contexts are drawn from the best fit's tokens so far, and each round
   finds more of them (SmolLM2, 8 prose and code windows: 6 of 8 token sets whole after a first round from corpus
   windows, 8 of 8 after the second or third). The MLP's Jacobian has a few
   weak directions in which float32's rounding of ``h`` leaves ``x`` undetermined (SmolLM2: its smallest singular
   value about 1e-3 against 1 for most): they are left free in the next step.
2. **The tokens** (as a set): ``z = o_proj^-1(x - e_T)`` is fitted, head by head, with weights summing to one over a
   support of tokens grown one at a time (simultaneous orthogonal matching pursuit over the vocabulary's value
   vectors, every head sharing the support, then exchanges of tokens; :mod:`.firstsupport`). The prompt's distinct
   tokens are all in it once the fit's residual falls to the noise.
3. **Their order** from the fitted weights (:mod:`.firstorder`): a token's weight in each head is the softmax of its
   query-key logit at its position, known for every token and position.

SmolLM2, float32, held-out 8-token texts (``benchmarks/bench_last.py``): docs/results.md. Everything here proposes
whole prompts; they are verified by a forward and judged by the acceptor like any other (:mod:`.last`).
Blocks of another shape (other norms around the MLP, query or key norms) are declined (:meth:`FirstBlock.of` checks
the decomposition against the model's own forward), and so are states narrower than ``WIDTH``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import jacrev

from ..corpora import sample_prompts
from ..models import LoadedModel
from ..models.kv import attention_kind, rotary_turn
from ..paths import past
from .firstorder import orders
from .firstsupport import FITTED, strength, support

log = logging.getLogger(__name__)

STARTS = 4  # preimage solves per round, each from the residual of the last token after another context
SCREENED = 64  # contexts per round whose residuals' states are compared with the target (the nearest are solved from)
CONTEXT = 7  # tokens in each such context
ROUNDS = 4  # rounds of fits per last token, each started from the best fit's tokens so far
POOL = 10  # the best fit's strongest tokens the next round's contexts are drawn from
STRONG = 0.02  # a token whose weight reaches this in some head counts as one of the fit's (a new set: new orders)
STEPS = 40  # Levenberg-Marquardt iterations per solve at most
WEAK = 16  # the MLP's weakest input directions left free in the token fit
EXTRA = 4  # support tokens beyond the longest prompt tried (the pursuit's first picks are not always the prompt's)
WIDTH = 256  # narrower states are declined: too few coordinates to single out a prompt's tokens in a vocabulary
ALONG = 3  # a normalised vector: token fits per start at most (each moves the residual by the last fit's free part)
CHECK = 1e-3  # relative disagreement with the model's own first block above which the decomposition is declined


@dataclass(frozen=True)
class FirstBlock:
    """The first block's parts (float64 copies of its attention and MLP; the vocabulary's value vectors)."""

    model: LoadedModel
    attention: nn.Module
    mlp: nn.Module
    norm1: nn.Module
    norm2: nn.Module
    rotary: nn.Module
    values: torch.Tensor  # [V, kv_heads, head_dim] float32: every token's value vectors
    o_inverse: torch.Tensor  # [d, d] float64
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: LoadedModel) -> FirstBlock | None:
        """The first block as this module reads it, or None where its shape is not ``x = e + attn(norm1(e))``, ``h =
        x + mlp(norm2(x))`` with rotary queries and keys (checked on a short prompt against the model's forward)."""
        probe = model.probe
        block = probe.blocks[0]
        attention = getattr(block, "self_attn", None)
        parts = ("q_proj", "k_proj", "v_proj", "o_proj")
        rotary = getattr(probe.base, "rotary_emb", None)
        if attention is None or rotary is None or any(not hasattr(attention, p) for p in parts):
            return None
        if not all(hasattr(block, p) for p in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return None
        if any(hasattr(attention, p) for p in ("q_norm", "k_norm")) or hasattr(block, "pre_feedforward_layernorm"):
            return None
        config = probe.config
        if probe.hidden_size < WIDTH:
            return None
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        o_weight = attention.o_proj.weight.detach().double().cpu()
        if o_weight.shape[0] != o_weight.shape[1] or getattr(attention.o_proj, "bias", None) is not None:
            return None
        double = copy.deepcopy(nn.ModuleDict({"a": attention, "m": block.mlp, "n1": block.input_layernorm,
                                              "n2": block.post_attention_layernorm})).double().cpu()  # fmt: skip
        with torch.no_grad():
            normed = double["n1"](probe.embedding.weight.detach().double().cpu())
            values = double["a"].v_proj(normed).float().view(-1, kv_heads, head_dim)
        found = cls(
            model, double["a"], double["m"], double["n1"], double["n2"], rotary, values,
            torch.linalg.inv(o_weight), heads, kv_heads, head_dim,
        )  # fmt: skip
        return found if found._agrees() else None

    # ------------------------------------------------------------------ the block's pieces
    @property
    def _kind(self) -> str | None:
        """The first block's kind of attention where the rotary module keeps one embedding per kind."""
        return attention_kind(self.rotary, self.model.probe.config, 1)

    def embeds(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model.probe.embedding(torch.tensor(ids, device=self.model.probe.device)).double().cpu()

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """``x + mlp(norm2(x))``: the layer-1 state of a residual ``x`` (float64)."""
        return x + self.mlp(self.norm2(x))

    def logits(self, tokens: list[int], last: int, length: int) -> torch.Tensor:
        """``[heads, len(tokens), length]``: the attention logit of the last position (``last`` at ``length - 1``)
        on each token at each position."""
        query, keys = self._query(self._normed([last])[0], length), self._keys(self._normed(tokens))
        at = [self._scores(query, keys, torch.full((len(tokens),), j)) for j in range(length)]
        return torch.stack(at, dim=-1)

    def residual(self, ids: list[int]) -> torch.Tensor:
        """The last position's residual ``x`` after the first block's attention, computed here (float64)."""
        length, normed = len(ids), self._normed(ids)
        query, keys = self._query(normed[-1], length), self._keys(normed)
        weights = torch.softmax(self._scores(query, keys, torch.arange(length)), dim=-1)  # each key at its position
        with torch.no_grad():
            values = self.attention.v_proj(normed).view(length, self.kv_heads, self.head_dim)
            per_head = values.repeat_interleave(self.heads // self.kv_heads, 1)  # [n, heads, head_dim]
            z = torch.einsum("hn,nhd->hd", weights, per_head).reshape(-1)
            return self.embeds(ids[-1:])[0] + self.attention.o_proj(z)

    def _normed(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.norm1(self.embeds(ids))

    def _query(self, normed: torch.Tensor, length: int) -> torch.Tensor:
        """``[heads, head_dim]``: the query of a normed row at position ``length - 1``, turned."""
        with torch.no_grad():
            query = self.attention.q_proj(normed[None]).view(1, self.heads, self.head_dim)
        turned = rotary_turn(
            self.rotary, query, torch.tensor([length - 1]), device=self.model.probe.device, kind=self._kind
        )
        return turned[0]

    def _keys(self, normed: torch.Tensor) -> torch.Tensor:
        """``[n, kv_heads, head_dim]``: the keys of normed rows, not turned."""
        with torch.no_grad():
            return self.attention.k_proj(normed).view(len(normed), self.kv_heads, self.head_dim)

    def _scores(self, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[heads, n]``: the scaled logit of ``query`` on each key turned at its position in ``positions``."""
        turned = rotary_turn(self.rotary, keys, positions, device=self.model.probe.device, kind=self._kind)
        group = self.heads // self.kv_heads
        logits = torch.einsum("nhd,hd->hn", turned.repeat_interleave(group, 1), query)
        return logits * float(getattr(self.attention, "scaling", self.head_dim**-0.5))

    def _agrees(self) -> bool:
        ids = [int(t) for t in torch.randint(0, self.values.shape[0], (5,), generator=torch.Generator().manual_seed(0))]
        probe, layer = self.model.probe, self.model.probe.layer(1)
        state = probe.states(torch.tensor([ids], device=probe.device), [layer])[layer][0, -1]
        with torch.no_grad():
            mine = self.mlp_residual(self.residual(ids))
        gap = float((mine - state.double().cpu()).norm() / state.double().norm())
        log.debug("first block decomposition: relative disagreement %.2e", gap)
        return gap < CHECK

    # ------------------------------------------------------------------ proposals
    def proposals(
        self, vector: torch.Tensor, lasts: list[int], max_length: int, deadline: float, normalised: bool = False
    ) -> Iterator[list[tuple[int, ...]]]:
        """Candidate prompts of 2..``max_length`` tokens ending in each of ``lasts`` (the vector's readings), one
        length per batch (in :func:`_lengths`' order), until the ``deadline``: after each fit better than the last
        whose strongest tokens are new (so that the consumer, verifying them, may stop as soon as the prompt is among
        them). ``normalised``: the vector is a state's direction only (its norm is found with the residual,
        :meth:`_fit`)."""
        target = vector.double().cpu().reshape(-1)
        if normalised:
            target = target / target.norm()
        for last in lasts:
            best, seen = None, set()
            for round_ in range(ROUNDS):
                for start in self._starts(target, last, best, round_, normalised):
                    if past(deadline):
                        return
                    fit = self._fit(target, last, max_length + EXTRA, start, normalised)
                    if best is not None and fit[2] >= best[2]:
                        continue
                    best = fit
                    tokens, weights, _ = best
                    strong = frozenset(t for t, w in zip(tokens, strength(weights), strict=True) if w > STRONG)
                    if strong in seen:
                        continue
                    seen.add(strong)
                    for length in _lengths(len(strong), max_length):
                        yield orders(self.logits(tokens, last, length), weights, tokens, tokens.index(last))

    def _fit(self, target: torch.Tensor, last: int, steps: int, start: torch.Tensor, normalised: bool = False):
        """The fit (tokens, weights ``[heads, n]``, residual) of the preimage of ``target`` found from ``start``.

        ``normalised``: ``target`` is a unit direction. The residual is then solved for the state's direction (not its
        size: a fit of the size-dependent difference would shrink the state towards zero). Such residuals form a
        curve (the state's norm along it), and the curve's tangent is left free in the token fit with the MLP's weak
        directions; the residual is moved by the fit's free part and solved again while the fit improves (``ALONG``
        times at most, and not once it fits to ``FITTED``). SmolLM2, 8 held-out windows, two starts each, one solve of
        the direction: the prompt's token set whole from 11 of the 16, against 7 of 16 solving for the state itself
        (a ``/tmp`` script)."""
        if not normalised:
            return self._tokens(_preimage(self.mlp_residual, target, start), last, steps, None)[0]

        def direction(x: torch.Tensor) -> torch.Tensor:
            state = self.mlp_residual(x)
            return state / state.norm()

        x, best = _preimage(direction, target, start), None
        for moves in range(ALONG):
            fit, shift, settled = self._tokens(x, last, steps, target)
            if best is not None and fit[2] >= best[2]:
                break
            best = fit
            if settled or moves == ALONG - 1:
                break
            x = _preimage(direction, target, x - shift)
        return best

    def _tokens(self, x: torch.Tensor, last: int, steps: int, along: torch.Tensor | None):
        """The token fit of the residual ``x`` (tokens, weights, residual norm), its free part in ``x``'s space (the
        move towards the prompt's residual) and whether it fits to ``FITTED``. ``along``: the state's direction, whose
        tangent is also free."""
        jacobian = jacrev(self.mlp_residual)(x)
        weak = torch.linalg.svd(jacobian).Vh[-WEAK:].T  # [d, WEAK]
        if along is not None:
            tangent = torch.linalg.solve(jacobian, along)
            weak = torch.cat([weak, (tangent / tangent.norm())[:, None]], 1)
        z = self.o_inverse @ (x - self.embeds([last])[0])
        tokens, weights, residual, free = support(self.values, self.heads, z, self.o_inverse @ weak, last, steps)
        return (tokens, weights, residual), weak @ free, residual <= FITTED * float(z.norm())

    def _starts(self, target: torch.Tensor, last: int, best, round_: int, normalised: bool) -> list[torch.Tensor]:
        """Residuals to start from: the last token after ``SCREENED`` contexts, windows of a corpus at first (records;
        random ids for a model without a tokenizer), then orders of the best fit's strongest tokens (each round's fit
        holds more of the prompt's tokens, and a start made of them lies nearer its residual); of these, the
        ``STARTS`` whose states lie nearest ``target`` (by direction where ``normalised``). The solve ends in the
        prompt's residual from a near start far more often than from a far one (SmolLM2, 16-token held-out windows:
        the 4 nearest of 128 starts all ended in it for 2 of 4 prompts, 3 of them in a residual holding 10 of its 13
        tokens for the third, the nearest in one holding 7 of 15 for the fourth; the 2 farthest in none)."""
        generator = torch.Generator().manual_seed(last * ROUNDS + round_)
        if best is None:
            contexts = self._contexts(generator)
        else:
            tokens, weights, _ = best
            pool = [tokens[i] for i in strength(weights).argsort(descending=True).tolist() if tokens[i] != last][:POOL]
            contexts = [[pool[i] for i in torch.randperm(len(pool), generator=generator)[:CONTEXT]] for _ in
                        range(SCREENED)]  # fmt: skip
        residuals = torch.stack([self.residual([*c, last]) for c in contexts])
        with torch.no_grad():
            states = self.mlp_residual(residuals)
        if normalised:
            states = states / states.norm(dim=-1, keepdim=True)
        nearest = (states - target).norm(dim=-1).argsort()[:STARTS]
        return list(residuals[nearest])

    def _contexts(self, generator: torch.Generator) -> list[list[int]]:
        tokenizer = self.model.tokenizer
        if tokenizer is not None:
            seed = int(torch.randint(0, 2**31, (1,), generator=generator))
            windows, _ = sample_prompts(tokenizer, "records", 2 * SCREENED, max_tokens=CONTEXT, seed=seed)
            contexts = [list(w.ids) for w in windows if len(w.ids) == CONTEXT][:SCREENED]
            if len(contexts) >= STARTS:
                return contexts
        return torch.randint(0, self.values.shape[0], (SCREENED, CONTEXT), generator=generator).tolist()


def first_block(model: LoadedModel) -> FirstBlock | None:
    """The model's first block as read here (made once per model object), None where it cannot be."""
    if "first_block" not in model.memo:
        model.memo["first_block"] = FirstBlock.of(model)
    return model.memo["first_block"]


def _lengths(distinct: int, longest: int) -> list[int]:
    """Lengths 2..``longest`` in the order tried: from the fit's count of ``distinct`` strong tokens up (a prompt holds
    at least as many tokens as it has distinct ones), then down (a strong token may be none of the prompt's)."""
    first = min(max(distinct, 2), longest)
    return [*range(first, longest + 1), *range(first - 1, 1, -1)]


def _preimage(function, target: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """An ``x`` near ``start`` with ``function(x)`` nearest ``target`` (Levenberg-Marquardt, float64)."""
    x, damping = start.clone(), 1.0
    eye = torch.eye(x.numel(), dtype=torch.float64)
    with torch.no_grad():
        value = function(x)
    residual, scale = value - target, float(value.norm())  # the stop is relative to the function's size
    cost = residual.norm()
    for _ in range(STEPS):
        jacobian = jacrev(function)(x)
        gradient, normal = jacobian.T @ residual, jacobian.T @ jacobian
        while damping < 1e8:
            step = torch.linalg.solve(normal + damping * eye, gradient)
            with torch.no_grad():
                trial = function(x - step) - target
            if trial.norm() < cost:
                x, residual, cost, damping = x - step, trial, trial.norm(), max(damping / 3, 1e-9)
                break
            damping *= 4
        if damping >= 1e8 or cost < 1e-9 * scale:
            break
    return x.detach()
