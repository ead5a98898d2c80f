"""The engine's notes on positions that fit no candidate (:mod:`lminvert.invert.misfits`): put down to the states
only where no stopped position and no guess among fitting candidates came before them."""

from __future__ import annotations

import re
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from lminvert.invert import acceptor
from lminvert.invert.misfits import misfit_notes
from lminvert.invert.sources import Exact

SURE = SimpleNamespace(uncertain=False, reason="the plain forward reproduces the observation")
MISFIT = SimpleNamespace(uncertain=True, reason=acceptor.NO_FIT)
GUESS = SimpleNamespace(uncertain=True, reason=acceptor.SEVERAL)


def _search(positions, first_cut=None):
    settings = SimpleNamespace(guess_ends=False, late=lambda: False)
    cut = 0 if first_cut is None else len(positions) - first_cut
    return SimpleNamespace(positions=positions, first_cut=first_cut, cut=cut, settings=settings)


def _states_count(notes) -> int:
    said = [n for n in notes if "do not match this model" in n]
    return int(re.match(r"(\d+) of", said[0]).group(1)) if said else 0


def test_misfits_after_a_guess_where_candidates_fit_are_put_down_to_the_guess_not_to_the_states():
    """A sink's guess (several candidates fit) at position 1 of a bfloat16 capture, then nothing fits after the wrong
    token: the note names the guess; the states are not said to mismatch the model."""
    notes = misfit_notes(_search([SURE, GUESS, MISFIT, MISFIT]), Exact())
    assert _states_count(notes) == 0, notes
    assert any("2 of 4 positions from position 2 on fit no candidate after position 1's guess" in n for n in notes)


def test_misfits_with_nothing_before_them_say_the_states_do_not_match():
    assert _states_count(misfit_notes(_search([MISFIT, MISFIT, MISFIT]), Exact())) == 3
    notes = misfit_notes(_search([SURE, MISFIT, GUESS, MISFIT]), Exact())  # one before the guess, one after it
    assert _states_count(notes) == 1 and any("1 of 4 positions from position 3 on" in n for n in notes), notes


def test_a_time_bound_before_the_guess_keeps_its_own_note():
    notes = misfit_notes(_search([SURE, MISFIT, GUESS, MISFIT], first_cut=1), Exact())
    assert _states_count(notes) == 0 and any("where the time bound first stopped" in n for n in notes), notes


@given(st.lists(st.sampled_from(["sure", "misfit", "guess"]), min_size=1, max_size=12), st.integers(0, 12))
def test_the_states_are_blamed_only_for_misfits_before_any_cut_or_guess(kinds, cut_at):
    positions = [{"sure": SURE, "misfit": MISFIT, "guess": GUESS}[k] for k in kinds]
    first_cut = cut_at if cut_at < len(positions) else None
    notes = misfit_notes(_search(positions, first_cut), Exact())
    guessed = kinds.index("guess") if "guess" in kinds else len(kinds)
    stop = min(len(kinds) if first_cut is None else first_cut, guessed + 1)
    assert _states_count(notes) == kinds[:stop].count("misfit")
    later = kinds[stop:].count("misfit")
    assert (later > 0) == any(f"{later} of {len(kinds)} positions from position {stop} on" in n for n in notes)
