"""Verification: the forwards that compute candidates' states at a position for every prompt still searching it, and
what each prompt's search (:mod:`.search`) records from them. One-token continuations of every prompt's proposed
batch in one batched forward (split only when candidate rows x prefix length would exceed ``POSITIONS``); first
batches followed by their chains (:mod:`.speculation`) in another; large later batches screened first with bfloat16
GEMMs where the search screens (``SCREEN_FROM``); and the plain forwards, shaped like the observer's, that confirm a
contender. :func:`search_position` runs them until every prompt has decided the position."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..models import Layer, LayerProbe, NewKeys, Prefix
from .search import PromptSearch

POSITIONS = 1 << 19  # candidate rows x prefix length per verification forward (bounds the copied keys and values)
# positions after the confirmed one whose states a plain forward computes for the next positions' first guesses, where
# it starts from kept keys (:mod:`lminvert.models.observed`; None: to the end); measured: docs/history.md ("Constants")
PLAIN_AHEAD: int | None = 4
# a confirmation of more contenders than this computes one position after theirs only (a wide round: its contenders
# are rarely the next positions' guesses; SmolLM2 bfloat16, 1,024 contenders: 1.8 ms each against 3.1 ms with 4)
AHEAD_UPTO = 16
# candidates of a verification forward from which it is screened (below, a screened forward saves too little of a
# float32 one to pay for the full forward of its picks; measured: benchmarks/bench_screen.py, docs/history.md)
SCREEN_FROM = 64


@dataclass(frozen=True)
class Verified:
    """A verification's states ``[B, d]`` (float32) and the keys and values its forwards computed, by first row."""

    states: torch.Tensor
    chunks: tuple[tuple[int, NewKeys | None], ...]

    def keys(self, index: Sequence[int]) -> list[NewKeys | None]:
        """The keys and values of rows ``index`` of the batch, one row each (None where none were computed)."""
        out: list[NewKeys | None] = [None] * len(index)
        ends = [start for start, _ in self.chunks[1:]] + [len(self.states)]
        for (start, new), end in zip(self.chunks, ends, strict=True):
            mine = [n for n, i in enumerate(index) if start <= i < end]
            for n, keys in zip(mine, _rows(new, [index[n] - start for n in mine]), strict=True):
                out[n] = keys
        return out


def verify(
    probe: LayerProbe, prefix: Prefix, ids: torch.Tensor, rows: torch.Tensor | None, screen: bool = False
) -> Verified:
    """Verified states (float32) of candidates ``ids`` (on prefix rows ``rows``), in as few forwards as memory allows:
    each forward copies its rows' prefix keys and values, so rows x prefix length stays under ``POSITIONS``.
    ``screen``: screened states (bfloat16 GEMMs), without keys."""
    step = max(1, POSITIONS // (prefix.length + 1))
    states, chunks = [], []
    with torch.no_grad(), probe.screening() if screen else contextlib.nullcontext():
        for i in range(0, len(ids), step):
            part = None if rows is None else rows[i : i + step]
            if screen:
                out, new = probe.continuation(prefix, token_ids=ids[i : i + step], rows=part), None
            else:
                out, new = probe.continuation(prefix, token_ids=ids[i : i + step], rows=part, keys=True)
            states.append(out)
            chunks.append((i, new))
    return Verified(torch.cat(states).float(), tuple(chunks))


def _catch_up(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch]) -> None:
    """The deferred tokens' keys and values into the cache (one forward, counted as every prompt's prefix extension)
    before a forward reads it."""
    start = time.perf_counter()
    if probe.catch_up(prefix):
        share = (time.perf_counter() - start) / len(group)
        for search in group:
            search.clock.add("extension", share)
            search.clock.forwards += 1


def _given(search: PromptSearch) -> None:
    """Record the states a chain and a confirmation's plain forward computed for the search's position earlier
    (:mod:`.speculation`), if any: the same token's once, its plain state with the chain's keys. The plain state only
    where the position would be confirmed anyway (the ball is not decisive) or the scout's guesses are being followed
    (:mod:`.scout`): elsewhere a chain's state decides alone, and its keys grow the prefix without the forward a plain
    state's token needs."""
    if search.speculator is None:
        return
    chained, plain = search.speculator.take()
    if search.decisive and not search.speculator.seeded:
        plain = None
    same = chained is not None and plain is not None and chained[0] == plain[0]
    with search.clock("verification"):
        if chained is not None and not same:
            token, state, keys = chained
            search.verified(torch.tensor([token], device=state.device), state[None], lambda _: [keys], given=True)
        if plain is not None:
            search.given_plain(plain[0], plain[1], chained[2] if same and chained is not None else None)


def _tail(search: PromptSearch, ids: torch.Tensor, tree: bool) -> list[int] | None:
    """The guesses that should follow the candidates of the search's first batch ``ids`` in a chain (in a ``tree``:
    those :meth:`.Speculator.roots` names), or None."""
    ctx = search.ctx
    if search.speculator is None or ctx is None or ctx.rounds > 0:
        return None
    return search.speculator.tail(ctx.position, search.length, 1 if tree else len(ids), tree)


def _verify_proposals(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], proposals: list) -> None:
    """Verify the proposed batches ``(row, ids)`` of every prompt: one-token continuations in one batched forward,
    first batches with chains after them (:mod:`.speculation`) in another; record them, keep the keys of candidates
    inside the ball."""
    tree = probe.packs_chains(prefix)  # only the candidates a source guessed carry the chain, the others stand alone
    chained = [(row, ids, tail) for row, ids in proposals if (tail := _tail(group[row], ids, tree)) is not None]
    longest = 1 + max((len(tail) for _, _, tail in chained), default=0)
    if sum(len(ids) for _, ids, _ in chained) * (prefix.length + longest) > POSITIONS:  # too many copied keys
        chained = []
    riding = {row for row, _, _ in chained}
    plain = [(row, ids) for row, ids in proposals if row not in riding]
    if plain:
        _verify_batches(probe, prefix, group, plain)
    if chained:
        _verify_chains(probe, prefix, group, chained, tree)


def _verify_batches(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], plain: list) -> None:
    """Verify the one-token batches ``(row, ids)`` of ``plain`` and record them. The batches of ``SCREEN_FROM``
    candidates or more of searches that screen first run together in one forward with bfloat16 GEMMs, and only each
    one's picks (:meth:`PromptSearch.screen_picks`) join the other batches in the float32 forward (decided per
    prompt, so that a prompt's candidates are the same inverted alone or with others)."""
    start = time.perf_counter()
    fast = [(row, ids) for row, ids in plain if group[row].screens and len(ids) >= SCREEN_FROM]
    picks, forwards = {}, 0
    if fast:
        ids = torch.cat([p[1] for p in fast])
        screened = verify(probe, prefix, ids, _prefix_rows(prefix, fast, ids.device), screen=True)
        forwards += len(screened.chunks)
        for (row, _), part in zip(fast, screened.states.split([len(p[1]) for p in fast]), strict=True):
            picks[row] = (group[row].screen_picks(part), part)
    full = [(row, ids[picks[row][0]] if row in picks else ids) for row, ids in plain]
    full = [(row, ids) for row, ids in full if len(ids)]
    offsets, offset = {}, 0
    for row, mine in full:
        offsets[row] = offset
        offset += len(mine)
    verified = None
    if full:
        ids = torch.cat([p[1] for p in full])
        verified = verify(probe, prefix, ids, _prefix_rows(prefix, full, ids.device))
        forwards += len(verified.chunks)
    states = verified.states if verified is not None else torch.empty(0, probe.hidden_size)
    share = (time.perf_counter() - start) / len(plain)
    for row, mine in plain:
        search, at = group[row], offsets.get(row, 0)

        def keys_of(inside: list[int], at: int = at) -> list[NewKeys | None]:
            return [] if verified is None else verified.keys([at + i for i in inside])

        with search.clock("verification"):
            if row in picks:
                chosen, part = picks[row]
                search.screened(mine, part, chosen, states[at : at + len(chosen)], keys_of)
            else:
                search.verified(mine, states[at : at + len(mine)], keys_of)
        search.clock.add("verification", share)
        search.clock.forwards += forwards


def _prefix_rows(prefix: Prefix, batches: list, device: torch.device) -> torch.Tensor | None:
    """The prefix row of every candidate of the batches ``(row, ids, ...)``, in order (None for a one-row prefix)."""
    if prefix.size == 1:
        return None
    return torch.cat([torch.full((len(batch[1]),), batch[0], device=device) for batch in batches])


def _verify_chains(probe: LayerProbe, prefix: Prefix, group: list[PromptSearch], chained: list, tree: bool) -> None:
    """First batches ``(row, ids, tail)``, every candidate followed by its prompt's ``tail`` (in a ``tree``: only the
    candidates :meth:`.Speculator.roots` names, the others stand alone), in one forward. Rows shorter than the longest
    are padded with their last token, whose states are not read (in a tree they are not computed either)."""
    size = 1 + max(len(tail) for _, _, tail in chained)
    chains, lengths, roots = [], [], []
    for row, ids, tail in chained:
        speculator = group[row].speculator
        assert speculator is not None
        tokens = ids.tolist()
        ctx = group[row].ctx
        assert ctx is not None
        carriers = speculator.roots(ctx.position, tokens) if tree else range(len(tokens))
        roots.append(carriers)
        for i, token in enumerate(tokens):
            chain = [token, *tail] if i in carriers else [token]
            chains.append([*chain, *chain[-1:] * (size - len(chain))])
            lengths.append(len(chain))
    rows = _prefix_rows(prefix, [(row, ids) for row, ids, _ in chained], probe.device)
    start = time.perf_counter()
    states, new = probe.chains(
        prefix, torch.tensor(chains, device=probe.device), rows, lengths=lengths if tree else None
    )
    states = states.float()
    share = (time.perf_counter() - start) / len(chained)
    offset = 0
    for (row, ids, tail), carriers in zip(chained, roots, strict=True):
        search = group[row]
        assert search.speculator is not None
        mine = range(offset, offset + len(ids))
        batch = states[offset : offset + len(ids)]
        with search.clock("verification"):
            search.verified(ids, batch[:, 0], partial(_firsts, new, list(mine)))
            chain = partial(_chain_of, _rows(new, [mine[i] for i in carriers]), len(tail))
            search.speculator.store(
                [int(ids[i]) for i in carriers], tail, batch[list(carriers), 1 : 1 + len(tail)], chain
            )
        search.clock.add("verification", share)
        search.clock.forwards += 1
        offset += len(ids)


def _rows(new: NewKeys | None, rows: list[int]) -> list[NewKeys | None]:
    """Rows ``rows`` of a verification's keys and values, one each, copied once per block (None where none were
    computed): a batch holds thousands of candidates on a GPU, of which the search keeps a few, and a copy per
    candidate cost more than the forward there."""
    if new is None or not rows:
        return [None] * len(rows)
    taken = new.take(torch.tensor(rows, device=new.layers[0][0].device))
    return [taken.row(k) for k in range(len(rows))]


def _firsts(new: NewKeys | None, rows: list[int], inside: list[int]) -> list[NewKeys | None]:
    """The keys and values at the first chain position of the batch's rows ``rows[i]`` for ``i`` in ``inside``."""
    return [None if keys is None else keys.at(0) for keys in _rows(new, [rows[i] for i in inside])]


def _chain_of(carried: list[NewKeys | None], count: int, k: int) -> list[NewKeys | None]:
    """Root ``k``'s keys and values (``carried[k]``) at its chain's next ``count`` positions."""
    return [None if carried[k] is None else carried[k].at(j) for j in range(1, 1 + count)]


def search_position(probe: LayerProbe, prefix: Prefix, layer: Layer, group: list[PromptSearch]) -> None:
    """Verify and confirm candidates of every prompt in ``group`` at the current position until all are decided."""
    for search in group:
        _given(search)
    pending = list(range(len(group)))  # rows still searching
    while pending:
        proposals = []
        for row in pending:
            search = group[row]
            if not search.to_confirm and not search.done:
                ids = search.propose()
                if ids is not None:
                    proposals.append((row, ids))
        if proposals:
            _catch_up(probe, prefix, group)
            _verify_proposals(probe, prefix, group, proposals)
        for row in [row for row in pending if group[row].to_confirm]:  # plain forwards, shaped like each observation
            search = group[row]
            if search.settings.scouting:
                _confirm_cached(search)
                continue
            search.clock.forwards += 1  # one plain forward, however many contenders it holds
            with search.clock("verification"):
                search.confirm(list(search.to_confirm), plain_states(probe, layer, prefix, row, search))
        pending = [row for row in pending if not group[row].done]


def _confirm_cached(search: PromptSearch) -> None:
    """The scout's confirmation (:attr:`.search.Settings.scouting`): the contenders' verified states stand in for plain
    ones, without a forward (the scout only guesses; its guesses are judged on a plain forward later)."""
    assert search.ctx is not None
    ids = search.ctx.all_ids()
    index = [int((ids == token).nonzero()[0, 0]) for token in search.to_confirm]
    search.confirm(list(search.to_confirm), search.ctx.all_states()[index])


def plain_states(probe: LayerProbe, layer: Layer, prefix: Prefix, row: int, search: PromptSearch) -> torch.Tensor:
    """States ``[k, d]`` (float32) at the current position of prefix row ``row`` + each contender ``search`` asks
    to confirm, by one plain forward shaped like the observer's: each sequence the whole observed length, the
    positions after this one filled with the candidate (the model is causal: they cannot change this position's state,
    but the kernels' shapes then equal the observer's). On the same device, dtype and threads this reproduces the
    observed state bit for bit; measured on the CPU: an unpadded forward disagrees by up to 4e-2 of the norm in
    bfloat16. The first confirmation of a position holds one sequence, as the observer's forward did; later ones up to
    ``acceptor.MAX_CONFIRM`` (SmolLM2, layer 15, this project's CPU, 2 threads: each row of forwards of 2, 8 and 33 such
    sequences equalled the one-sequence forward bit for bit in float32, bfloat16 and float16; where a device rounds a
    batch differently, the row stays within the plain radius, calibrated on two-row forwards, and the position is
    decided by separation or flagged). With a speculator, the fill is the next positions' first guesses instead,
    whose states it keeps (:mod:`.speculation`). Where the probe can (:mod:`lminvert.models.observed`: a CPU in half
    precision), the forward starts from the keys and values the last confirmation kept for the prefix and computes
    the contender's position and ``PLAIN_AHEAD`` after it only, with the same bits."""
    t = prefix.length
    speculator = search.speculator
    fill = speculator.fill(t, search.length) if speculator is not None else []
    seqs = [[*prefix.rows[row], c, *(fill or [c] * (search.length - t - 1))] for c in search.to_confirm]
    stop = None if PLAIN_AHEAD is None else t + 1 + (PLAIN_AHEAD if len(seqs) <= AHEAD_UPTO else 1)
    rows = probe.plain_states(seqs, layer, upto=t, kept=search.plain_keys, stop=stop)
    states = rows.states.float()[:, t - rows.start :]
    if fill and speculator is not None:
        for c, row_states in zip(search.to_confirm, states, strict=True):
            speculator.store_plain(c, fill[: len(row_states) - 1], row_states[1:])
    search.plain_keys = rows.keys_of(0)  # the first contender's (closest in angle) start the next confirmation
    return states[:, 0]
