"""Where lminvert keeps converted models and other cached artefacts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$LMINVERT_CACHE`` if set, else ``~/.cache/lminvert``; created on first use."""
    root = os.environ.get("LMINVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lminvert")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
