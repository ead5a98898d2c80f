"""The recovered prefix of one rows search (:class:`Running`): one KV cache over every block, grown a token at a time,
that gives both the candidates' cached forward at the searched layer and the model's next-token prediction after the
prefix. Where the chosen token was a candidate run over it (:meth:`Running.candidates`), the cache grows from that
forward's keys and values and only the blocks above the layer run, on its state (none at the last block's layer),
which also gives the prediction; elsewhere one forward through every block does both.
"""

from __future__ import annotations

import torch

from ...models import Layer, LoadedModel, NewKeys, Prefix

OFFERED = 1024  # candidates of a position whose keys and values are kept (the latest batches'), at most


class Runs:
    """Candidates :meth:`Running.candidates` ran: their ids, states at the searched layer ``[n, d]`` and keys and values
    (None where no block ran)."""

    def __init__(self, ids: torch.Tensor, states: torch.Tensor, keys: NewKeys | None) -> None:
        self.ids, self.states, self.keys = ids.tolist(), states, keys

    def index(self, token: int) -> int | None:
        return self.ids.index(token) if token in self.ids else None


class Running:
    """The prefix recovered so far (:attr:`ids`) and the probe's cache of it over every block (``top``: the last
    block's layer, or ``final`` where the search's layer is), made where first asked and then grown by the tokens
    added since: the candidates' prefix at ``layer`` (:meth:`prefix`, a view of that cache), the model's prediction
    after it (:meth:`log_probs`). The cache holds one prompt's prefix only: a prefix that is not :attr:`ids` is
    computed elsewhere. ``reuse``: a token chosen from :meth:`candidates` grows the cache from their forward (False: a
    forward through every block, when next needed). ``predicts``: False where the search reads its prediction
    elsewhere (:meth:`.rankers.StateReading.priors`): the cache then holds the blocks up to the layer only, a chosen
    candidate's keys and values join it with no forward, and there is no :meth:`log_probs`."""

    def __init__(self, model: LoadedModel, layer, reuse: bool = True, predicts: bool = True) -> None:
        self.model, self.layer, self.predicts = model, layer, predicts
        probe = model.probe
        self.top = max(layer, probe.layer(probe.n_layers)) if predicts else layer
        # the blocks above the layer run alone on a state only where the blocks below can be skipped
        self.reuse = reuse and (layer.top_block == self.top.top_block or probe.skips_below)
        self.ids: list[int] = []
        self._full: Prefix | None = None  # the cache over ids[: self._full.length] (None: nothing computed yet)
        self._final: tuple[torch.Tensor, bool] | None = None  # the last token's state at top and whether it is normed
        self._scores: torch.Tensor | None = None  # the log-probabilities of the next token after ids
        self._offers: list[Runs] = []  # this position's candidates run over the cache (:meth:`candidates`)

    def add(self, token: int) -> None:
        """The next position's token: the cache grows from its forward where it was one of this position's
        :meth:`candidates` and the cache is up to date (only the blocks above the layer run), else when next asked for
        (one forward)."""
        token = int(token)
        offered = next(((runs, i) for runs in self._offers if (i := runs.index(token)) is not None), None)
        self._offers, self._scores, self._final = [], None, None
        if self.reuse and offered is not None and offered[0].keys is not None and self._current():
            runs, i = offered
            assert self._full is not None and runs.keys is not None
            pick = torch.tensor([i], device=runs.states.device)
            probe, keys = self.model.probe, runs.keys.take(pick)
            if self.predicts:
                self._full, final = probe.advance_above(self._full, [token], keys, runs.states[i : i + 1], self.layer)
                self._final = (final[0], True)
            else:
                self._full = probe.advance_from(self._full, [token], keys)
        self.ids.append(token)

    def holds(self, prefix_ids: list[int]) -> bool:
        """Whether ``prefix_ids`` is the running prefix (and not empty: an empty prefix has no caches)."""
        return bool(prefix_ids) and prefix_ids == self.ids

    def _current(self) -> bool:
        return self._full is not None and self._full.length == len(self.ids)

    def _catch_up(self) -> Prefix:
        """The cache over :attr:`ids`, the tokens added since it was last grown run through every block in one
        forward (which also gives the last one's final state)."""
        probe = self.model.probe
        if self._current():
            assert self._full is not None
            return self._full
        if self._full is None:
            self._full = probe.prefix(self.ids[:-1], self.top) if len(self.ids) > 1 else Prefix([[]], self.top, None)
        for token in self.ids[self._full.length : -1]:
            self._full = probe.defer(self._full, [token])
        self._full, final = probe.advance_rows(self._full, [self.ids[-1]])
        self._final = (final[0], False)  # the last block's output (advance_rows), before the final norm
        return self._full

    def prefix(self) -> Prefix:
        """The probe's prefix of :attr:`ids` at the searched layer (a view of the running cache: never grown
        itself)."""
        full = self._catch_up()
        return Prefix([list(full.rows[0])], self.layer, full.cache)

    def candidates(
        self, ids: torch.Tensor, layers: list[Layer] | None = None
    ) -> torch.Tensor | dict[Layer, torch.Tensor]:
        """The states ``[n, d]`` at the searched layer of candidates ``ids`` for the next position (the cached forward
        over :meth:`prefix`; with ``layers``, holding the searched one, a dict of the states at each); with ``reuse``
        their keys and values are kept until the next :meth:`add` (the latest ``OFFERED`` candidates' at most)."""
        probe = self.model.probe
        with torch.no_grad():
            if not self.reuse:
                return probe.continuation(self.prefix(), ids.to(probe.device), layers=layers)
            states, keys = probe.continuation(self.prefix(), ids.to(probe.device), layers=layers, keys=True)
        own = states[self.layer] if isinstance(states, dict) else states
        self._offers.append(Runs(ids, own, keys))
        while sum(len(r.ids) for r in self._offers) > OFFERED and len(self._offers) > 1:
            self._offers.pop(0)
        return states

    def log_probs(self) -> torch.Tensor:
        """The model's log-probabilities of every next token after :attr:`ids` ``[V]`` (float32, CPU; from the last
        token's final state; one forward where it is not known; a ValueError where it does not ``predict``)."""
        if not self.predicts:
            raise ValueError("this running prefix holds no blocks above its layer: it predicts nothing")
        if self._scores is None:
            if self._final is None:
                self._catch_up()
            assert self._final is not None
            state, normed = self._final
            logits = self.model.probe.next_token_logits(state, normed=normed, ranking=True)
            self._scores = logits.float().log_softmax(-1).cpu()
        return self._scores


def predicted(model: LoadedModel, prefix: list[int]) -> torch.Tensor:
    """The model's log-probabilities of every token after ``prefix`` ``[V]`` (float32, CPU) from one forward of it
    (after its start token where the prefix is empty; where the model has none, scores that order the tokens by id)."""
    probe = model.probe
    bos = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer is not None else None
    context = prefix or ([] if bos is None else [bos])
    if not context:  # nothing to predict from: every token alike, in the order of their ids
        return -torch.arange(probe.vocab_size, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([context], device=probe.device)
        logits = model.model(input_ids=ids, logits_to_keep=1).logits[0, -1]
    return logits.float().log_softmax(-1).cpu()
