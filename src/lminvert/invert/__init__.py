"""Exact prompt inversion from hidden states (SIPIT) and its baselines."""

from __future__ import annotations

import torch

from ..errors import LminvertError
from ..models import LayerSpec, LoadedModel
from ..models.compat import check_compatible
from ..models.loading import require_loaded
from ..models.ties import tied_token_groups
from ..states import HiddenStates
from .engine import InvertConfig, invert_prompt, progress_callback
from .policies import POLICIES, GradientPolicy, LinearPolicy, Policy, RandomPolicy, SweepPolicy
from .results import InversionResult, PositionResult
from .tolerance import add_noise

METHODS = ("sipit", "bruteforce")


def invert(
    model: LoadedModel,
    states: HiddenStates | torch.Tensor,
    layer: LayerSpec | None = None,
    *,
    method: str = "sipit",
    policy: str = "linear",
    noise: float = 0.0,
    seed: int = 0,
    max_candidates: int | None = None,
    first_table: bool = True,
    progress: bool = False,
) -> list[InversionResult]:
    """Recover the token ids of every prompt in ``states`` (one result per prompt).

    ``model`` comes from :func:`lminvert.load_model`; ``layer`` defaults to what the states file says (and must
    agree with it). ``noise`` adds relative Gaussian noise of
    that level to the states first (for robustness studies) and widens the acceptance tolerance to match.
    """
    if method not in METHODS:
        raise LminvertError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    if policy not in POLICIES:
        raise LminvertError(f"unknown policy '{policy}': use one of {', '.join(POLICIES)}")
    if noise < 0 or noise != noise:
        raise LminvertError("noise must be a non-negative number (a relative level, e.g. 0.001)")
    if isinstance(states, torch.Tensor):
        states = HiddenStates.from_array(states.detach().cpu())
    model = require_loaded(model, "invert")
    resolved = check_compatible(states, model, layer)
    config = InvertConfig(
        method=method,
        policy=policy,
        first_table=first_table,
        max_candidates=max_candidates,
        noise=noise,
        seed=seed,
        progress=progress,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    ties = {t: tuple(x for x in g if x != t) for g in tied_token_groups(model) for t in g}
    results = []
    for i, clean in enumerate(states.states):
        observed = add_noise(clean, noise, generator) if noise > 0 else clean
        callback, bar = progress_callback(len(clean), f"prompt {i + 1}/{len(states)}", progress)
        try:
            results.append(
                invert_prompt(
                    model,
                    observed,
                    resolved,
                    config,
                    clean_states=clean if noise > 0 else None,
                    on_position=callback,
                    ties=ties,
                )
            )
        finally:
            bar.close()
    return results


__all__ = [
    "POLICIES",
    "GradientPolicy",
    "InversionResult",
    "InvertConfig",
    "LinearPolicy",
    "Policy",
    "PositionResult",
    "RandomPolicy",
    "SweepPolicy",
    "invert",
    "invert_prompt",
]
