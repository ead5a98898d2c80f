"""What `collisions` and `exhaustive` do after their run: render the report, print the summary or the JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report import render
from ..report.collisions import summary_lines
from ..runs import RESULTS
from .common import print_json


def report_run(results, args: argparse.Namespace) -> int:
    paths = render(results, figure=not args.no_figure)
    if args.json:
        print_json(results.to_dict())
        return 0
    print("\n".join(summary_lines(results)))
    print(f"wrote {', '.join([str(Path(results.directory) / RESULTS), *paths.values()])}")
    return 0
