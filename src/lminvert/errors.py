"""User-facing errors.

Every error a user can cause (a wrong path, an unknown model, a layer out of range, NaN states...) is raised
as :class:`LminvertError` with a one-line message that says what to do. The CLI prints it on one line and
exits non-zero; library users can catch it.
"""

from __future__ import annotations


class LminvertError(Exception):
    """An error caused by the input, with a one-line message that says how to fix it."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
