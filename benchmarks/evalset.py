"""The benchmarks' evaluation set for inversion (prose, code, random ids, personal data): the same prompts the
experiments use, from :mod:`lminvert.experiments.prompts`."""

from lminvert.experiments.prompts import PERSONAL, EvalPrompt, evaluation_prompts

__all__ = ["PERSONAL", "EvalPrompt", "evaluation_prompts"]
