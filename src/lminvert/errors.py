"""User-facing errors.

Every error a user can cause (a wrong path, an unknown model, a layer out of range, NaN states...) is raised
as :class:`LminvertError` with a one-line message that says what to do. The CLI prints it on one line and
exits non-zero; library users can catch it.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any


class LminvertError(Exception):
    """An error caused by the input, with a one-line message that says how to fix it."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


KINDS = {  # what a value of each kind is called in an error, and the test of it (a bool is no number here)
    "int": ("an int", lambda v: isinstance(v, Integral) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, Real) and not isinstance(v, bool)),
    "flag": ("True or False", lambda v: isinstance(v, bool)),
    "text": ("a string", lambda v: isinstance(v, str)),
    "list": ("a list", lambda v: isinstance(v, list | tuple)),
    "mapping": ("a mapping", lambda v: isinstance(v, dict)),
}


def check_kind(name: str, value: Any, kind: str, hint: str = "") -> None:
    """A one-line error where ``value`` (the option ``name``) is not of ``kind`` (a key of :data:`KINDS`): "``name``
    must be an int``hint``, not str 'abc'"."""
    wanted, fits = KINDS[kind]
    if not fits(value):
        raise LminvertError(f"{name} must be {wanted}{hint}, not {type(value).__name__} {value!r:.60}")
