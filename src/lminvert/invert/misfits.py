"""What an engine search's result says about its states as a whole, from the positions that fit no candidate
(:data:`lminvert.invert.acceptor.NO_FIT`): put down to the states only where nothing before them could have led the
search astray (a position the time bound stopped, a guess where candidates did fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import acceptor

if TYPE_CHECKING:
    from .search import PromptSearch
    from .sources import ErrorModel


def misfit_notes(search: PromptSearch, source: ErrorModel) -> tuple[str, ...]:
    """What the prompt's result says about its states as a whole. Positions that fit no candidate from the first one
    the time bound stopped on are put down to it (a stopped position keeps a candidate that may be wrong, and every
    later one is searched after it), not to the states; so are those after a guess where candidates did fit (an
    ``uncertain`` position whose reason is not :data:`acceptor.NO_FIT`: several fit, a sink's row did not choose):
    the guess may be wrong. Only misfits before both say the states do not match the model."""
    positions, n = search.positions, len(search.positions)
    cut = n if search.first_cut is None else search.first_cut
    guessed = next((i for i, p in enumerate(positions) if p.uncertain and p.reason != acceptor.NO_FIT), n)
    first = min(cut, guessed + 1)
    misfit = [i for i, p in enumerate(positions) if p.reason == acceptor.NO_FIT]
    before, after = sum(i < first for i in misfit), sum(i >= first for i in misfit)
    notes: tuple[str, ...] = ()
    guess = search.settings.guess_ends and not search.settings.late()
    by = "a guess (the rows search takes the prompt over)" if guess else "the time bound"
    if search.cut:
        notes += (
            f"{by} stopped the search at {search.cut} of {n} positions: each kept the "
            "closest candidate of what it had verified",
        )
    if after and cut <= guessed:
        notes += (
            f"{after} of {n} positions from position {first} on, where {by} first "
            "stopped the search, fit no candidate: a stopped position's candidate may be wrong, and the positions "
            "after it were searched after it; give more time (--max-seconds) before concluding anything of the states",
        )
    elif after:
        notes += (
            f"{after} of {n} positions from position {first} on fit no candidate after position {guessed}'s guess "
            f"({positions[guessed].reason}): the guess may be wrong, and the positions after it were searched after "
            "it; this says nothing of the states",
        )
    if before:
        notes += (
            f"{before} of {n} positions: no candidate fits the error model '{source.label}': "
            "these states do not match this model's computation at this layer (another model, layer or dtype, a "
            "fine-tuned copy, a computation lminvert does not reproduce such as autocast's half-precision products, "
            "or an error larger than the model allows: try --source noise:LEVEL)",
        )
    return notes
