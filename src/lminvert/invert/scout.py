"""The scout: a whole-prompt guess found by a search whose cached forwards all run with bfloat16 GEMMs, then checked
by one plain float32 forward.

At a deep layer a verification forward of a few candidates costs about as much as reading the model's weights once
(SmolLM2, layer 30, this project's 2-core CPU: 47 ms for one candidate, 57-80 ms for the 8 candidates and a chain of
a first batch), and a prompt of 20 tokens takes 13-29 of them. With bfloat16 GEMMs
(:meth:`lminvert.models.LayerProbe.screening`) the same forwards read half the bytes: 41 / 48 / 71 ms for 1 / 8 / 32
candidates against 47 / 74 / 120 ms. Their states are about 1% of the norm off (layer 30: median 0.9%, at most 4.7%
over 228 positions of 12 held-out prompts, the prefix's keys from bfloat16 forwards too), while the nearest of the 63
tokens whose input vectors lie nearest the true one's was at least 4.6% (median 33%) away: such a state tells the
token, but cannot prove it.

So the scout runs the engine's own search (policies, chains, the next-token prior) with every cached forward from
position 1 on in bfloat16 (position 0's first batch in float32) and the screening radius as its ball
(:func:`scouting_calibration`), stopping a prompt at its first position that fits nothing
(:attr:`.search.Settings.scouting`). Its tokens are a guess, never an answer: the engine then computes the plain forward
of the whole guessed prompt, shaped like the observer's, and gives each position its state as a verified candidate
with its plain distance (:meth:`.speculation.Speculator.seed`). The acceptor decides every position on that evidence as
on any other: a right guess that reproduces the observation is decided without a forward of its own, and from the
first position decided otherwise the search goes on as without the scout (its forwards in float32).
A wrong guess costs the scout's time, never the answer.
"""

from __future__ import annotations

from ..models import Layer, LoadedModel
from .acceptor import TOKEN_GAP_SAFETY
from .tolerance import SAFETY, Calibration, calibrate, scout_error, screen_calibration

BUDGET = 256  # candidates per position before the scout gives a position up (and its prompt stops there)
FROM = 0.3  # the scout runs from this fraction of the model's depth on (below, a float32 forward costs little)
# the error of a state computed with bfloat16 GEMMs, relative to its norm, at which the scout runs by default (the
# disagreement the scout reads, :func:`error`). With their maximum and 2% (before): SmolLM2 0.97-1.93% at layers 9-30
# (where it took 0.78-0.90x the time), Gemma-3-270m 2.4% and 6.1% at layers 9 and 18 (1.55x and 1.67x: its guesses
# broke off, its ball 4x one outlier's). With their 90th percentile: SmolLM2 0.8-1.3% at layers 15-30 (0.98-1.05x the
# time of the maximum's ball), Gemma-3-270m 0.8% at layer 9 (0.85x the time without the scout) and 1.9% at 18 (1.39x:
# not scouted); chosen on these two models (docs/results.md, "The scout's ball")
MAX_ERROR = 0.015
WORST_ERROR = 0.02  # the rule's bound on the maximum, where TYPICAL is off
# the scout's ball and its rule read the screened disagreements' 90th percentile (:func:`.tolerance.scout_error`): the
# ball, SAFETY times it, still holds their maximum on the models measured (SmolLM2 layer 30: 4 x 1.3% against 1.9%,
# Gemma-3-270m layer 9: 4 x 0.8% against 2.4%), and one outlier no longer widens it 4 times over (False: the maximum,
# with the rule at WORST_ERROR)
TYPICAL = True


def error(model: LoadedModel, layer: Layer) -> float:
    """The screened states' relative disagreement the scout reads: their 90th percentile where :data:`TYPICAL` is on,
    else their maximum (:mod:`.tolerance`)."""
    return scout_error(model, layer) if TYPICAL else screen_calibration(model, layer)


def scouting_calibration(model: LoadedModel, layer: Layer, scale: float = 1.0) -> Calibration:
    """The scout's radii: its cached ball the screening radius of :func:`error` (bfloat16 GEMMs), the tokens' distance
    apart (:attr:`.acceptor.Radii.apart`) set to twice that ball, so that one candidate in the ball's inner half is
    taken at once and the contenders reach no farther than the ball (the scout only guesses; the acceptor judges its
    guesses on plain forwards)."""
    measured = calibrate(model, layer)
    screen = error(model, layer)
    gap = TOKEN_GAP_SAFETY * 2.0 * scale * SAFETY * screen
    return Calibration(cached=screen, plain=screen, gap=gap, samples=measured.samples, scale=scale)


def pays(model: LoadedModel, layer: Layer) -> bool:
    """Whether the scout pays here: a float32 model on a CPU with native bfloat16 GEMMs
    (:attr:`lminvert.models.LayerProbe.can_screen`), at a layer from ``FROM`` of the depth on, whose states computed
    with bfloat16 GEMMs lie at most ``MAX_ERROR`` of the norm off (:func:`error`)."""
    probe = model.probe
    if not (probe.can_screen and int(layer) >= FROM * probe.n_layers):
        return False
    return error(model, layer) <= (MAX_ERROR if TYPICAL else WORST_ERROR)
