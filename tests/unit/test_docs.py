"""The documentation runs: every ``sh`` and ``python`` block of README.md and docs/guide.md, in order, in one empty
folder per page (a block may use what an earlier one wrote), unless the line before it says
``<!-- not run here: REASON -->``. ``sh`` blocks hold ``lminvert`` commands only, run in this process (as
``lminvert.cli.main``), each expected to succeed; ``python`` blocks run as scripts. And every decimal figure README.md
states outside its code blocks is one docs/results.md holds."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/guide.md"]
SKIP = re.compile(r"<!--\s*not run here:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # the reason it is not run, if the line before says so


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.search(before)
        out.append(Block(opening.group(1), "\n".join(lines[i + 1 : end]), i + 1, marker.group(1) if marker else None))
        i = end + 1
    return out


def _run_sh(page: str, block: Block) -> None:
    for offset, line in enumerate(block.code.splitlines(), start=1):
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        where = f"{page}:{block.line + offset}"
        assert argv[0] == "lminvert", (
            f"{where}: only lminvert commands run here; mark the block <!-- not run here: why -->"
        )
        proc = run_cli(*argv[1:])
        assert proc.returncode == 0, f"{where}: `{line}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}"


@pytest.mark.parametrize("page", PAGES)
def test_every_example_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran = 0
    for block in blocks(ROOT / page):
        if block.language not in ("sh", "python"):
            continue
        if block.skip is not None:
            assert block.skip, f"{page}:{block.line}: say why the block is not run"
            continue
        if block.language == "sh":
            _run_sh(page, block)
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block.code, f"{page}:{block.line}", "exec"), {"__name__": "__main__"})
        ran += 1
    assert ran >= 2, f"{page}: only {ran} examples ran"


def test_the_readmes_figures_are_in_the_results_page():
    readme = (ROOT / "README.md").read_text()
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.S | re.M)
    results = (ROOT / "docs" / "results.md").read_text()
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", prose))
    missing = sorted(f for f in figures if f not in results)
    assert not missing, f"README.md states {missing}, which docs/results.md does not hold"
