"""How numbers are written in tables and sentences: one format for results.md, the HTML report and the summaries
experiments, labs and the audit write."""

from __future__ import annotations

import math
from typing import Any


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: numbers to ``digits`` significant figures, None/NaN as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:,.{max(digits - len(str(int(abs(value)))), 0)}f}"
    return str(value)


def pm(mean: float, std: float, digits: int = 3) -> str:
    return f"{fmt(mean, digits)} ± {fmt(std, digits)}"
