"""Prompt sources: user files (.txt one prompt per line, .jsonl with a "text" field)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import LminvertError


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a .txt file (one per non-empty line) or a .jsonl file (a "text" field per line)."""
    path = Path(path)
    if not path.is_file():
        raise LminvertError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise LminvertError(f"unsupported prompt file '{path.name}': use .txt (one prompt per line) or .jsonl")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LminvertError(f"cannot read {path} as UTF-8 text ({type(exc).__name__})") from exc
    prompts: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if suffix == ".txt":
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise LminvertError(f"{path.name} line {number} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LminvertError(f'{path.name} line {number} has no string "text" field')
        if record["text"].strip():
            prompts.append(record["text"])
    if not prompts:
        raise LminvertError(f"{path} holds no prompts (it is empty or blank)")
    return prompts
