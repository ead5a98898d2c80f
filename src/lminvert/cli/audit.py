"""`lminvert audit`: what leaks from a deployment, from which layer and which artefact, under which defence, and what
each defence costs.

For each leak (states: every position's residual; kv: a block's KV cache; last: the last position's state), layer and
defence, the strongest attack lminvert has recovers the prompts, and the deployment's next-token predictions computed
with the defended artefact are compared with the undefended model's. Writes results.json, results.md (the leak
matrices, a verdict sentence per leak and layer) and heatmaps into --out; resumes from --out after an interruption.
`lminvert report DIR` renders it beside other runs.
"""

from __future__ import annotations

import argparse
import sys

from ..audit import DEFAULT, LEAKS, audit
from ..errors import LminvertError
from ..paths import check_output_dir
from .common import add_command, add_model_args, model_from_args, print_json
from .experiment import _sizes

EXAMPLES = """examples:
  lminvert audit --quick --out runs/audit-quick
  lminvert audit --layers 1,middle,-1 --leaks states,kv --defences none,noise:0.01,permute --out runs/audit
  lminvert audit --model tiny-llama --quick --defences none,project:16 --size 'kinds=["random"]' --out runs/tiny
  lminvert report runs/audit --out audit.html
"""


def _list(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "audit", "what leaks from states, a KV cache or an embedding, under which defence", __doc__, EXAMPLES
    )
    add_model_args(parser)
    parser.add_argument("--layers", help="layers, e.g. 1,middle,-1 (default: 1,middle,-1; --quick: 1,middle)")
    parser.add_argument("--leaks", help=f"comma-separated: {', '.join(LEAKS)} (default: all)")
    parser.add_argument("--defences", help=f"comma-separated (default: {','.join(DEFAULT)})")
    parser.add_argument("--prompts", metavar="FILE", help="a text file, one prompt a line (default: prose and chat)")
    parser.add_argument("--quick", action="store_true", help="2 prompts of 8 tokens, layers 1 and middle, 4 defences")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, noise and permutations")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE", help="e.g. --size prompts=5")
    parser.add_argument("--out", required=True, help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json instead of the summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sizes = _sizes(args.size)
    layers = _list(args.layers)
    if layers is not None:
        sizes["layers"] = [int(x) if x.lstrip("-").isdigit() else x for x in layers]
    for key, value in (("leaks", _list(args.leaks)), ("defences", _list(args.defences))):
        if value is not None:
            sizes[key] = value
    if args.prompts:
        sizes["prompts_file"] = args.prompts
    out = check_output_dir(args.out)
    if sizes.get("leaks") == [] or sizes.get("defences") == [] or sizes.get("layers") == []:
        raise LminvertError("--layers, --leaks and --defences each need at least one name")
    try:
        doc = audit(
            out, model=args.model, quick=args.quick, load=lambda name: model_from_args(args, name), seed=args.seed,
            progress=not args.json, **sizes,
        )  # fmt: skip
    except KeyboardInterrupt:
        print(
            f"lminvert: interrupted; finished cells are kept in {out}: rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    if args.json:
        print_json(doc)
        return 0
    for note in doc["summary"]["notes"]:
        print(note)
    print(f"audit: {len(doc['rows'])} rows in {doc['seconds']:.1f} s; results: {out / 'results.md'}")
    return 0
