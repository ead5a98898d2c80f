"""`lminvert report`: one self-contained HTML page from experiment, lab, collision, exhaustive and inversion
outputs (figures embedded, no network, no script). With --out FILE.md: one markdown page instead, figures copied
beside it; an existing page keeps everything outside its generated block."""

from __future__ import annotations

import argparse

from ..paths import check_output_file
from ..report.html import write_report
from .common import add_command

EXAMPLES = """examples:
  lminvert report runs/methods runs/depth runs/c2k --out report.html
  lminvert report result.json --title "What leak.safetensors held" --out leak.html   # from invert --out result.json
  lminvert report out/results/* --out docs/results.md
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "report", "one HTML page from output directories and inversion results", __doc__, EXAMPLES
    )
    parser.add_argument("inputs", nargs="+", help="output directories and/or inversion result .json files")
    parser.add_argument("--out", required=True, help="the .html (or .md) file to write")
    parser.add_argument("--title", default="lminvert report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = check_output_file(args.out, (".html", ".md"))  # one page, or markdown
    if out.suffix == ".md":
        from ..report.markdown_page import write_markdown

        path = write_markdown(args.inputs, out, args.title)
    else:
        path = write_report(args.inputs, out, args.title)
    print(f"report: {path}")
    return 0
