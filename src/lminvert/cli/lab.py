"""`lminvert lab`: injectivity at initialisation, through training, and where it breaks.

  init   many seeds of small random GPT-2 and Llama models: the minimum pairwise distance per layer
  train  train a small GPT-2 from scratch (SGD and Adam), measuring separation and loss every k steps;
         the trained models are saved under OUT/models/<optimiser> for `--model DIR`
  break  constructions that collide on purpose (tied rows, hard steps, quantised activations, indistinct
         positions), their analytic contrasts, and what inversion does on them

Each writes results.json, results.md and figures/ into --out through the same runner as `lminvert experiment`,
resumes from --out after an interruption, and is included by `lminvert report`.
"""

from __future__ import annotations

import argparse

from ..errors import LminvertError
from ..lab import LABS, get_lab
from ..lab import run as run_lab
from ..paths import check_output_dir
from .common import add_command, print_json

EXAMPLES = """examples:
  lminvert lab init --quick --out runs/lab-init
  lminvert lab train --out runs/lab-train                 # trained models in runs/lab-train/models/{sgd,adam}
  lminvert encode --model runs/lab-train/models/adam --layer -1 --text "def main():" --out trained.safetensors
  lminvert lab break --quick --out runs/lab-break
  lminvert report runs/lab-init runs/lab-train runs/lab-break --out lab.html
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "lab", "the injectivity lab: at random init, through training, constructed breaks", __doc__, EXAMPLES
    )
    parser.add_argument("name", choices=list(LABS), help="which lab")
    parser.add_argument("--quick", action="store_true", help="the small size (about a minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models and prompts drawn")
    parser.add_argument("--out", help="output directory (reused to resume)")
    parser.add_argument("--json", action="store_true", help="print results.json instead of the summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    lab = get_lab(args.name)
    if not args.out:
        raise LminvertError("--out DIR is required: the directory the results go to (and resume from)")
    out = check_output_dir(args.out)
    doc = run_lab(lab.name, out, quick=args.quick, seed=args.seed, progress=not args.json)
    if args.json:
        print_json(doc)
        return 0
    print(f"{lab.title}: {len(doc['rows'])} rows in {doc['seconds']:.1f} s")
    print(f"  results: {out / 'results.json'}, {out / 'results.md'}")
    figures = [f for f in doc["summary"]["figures"] if f.get("kind") != "file"]
    if figures:
        print(f"  figures: {out / 'figures'}/ ({', '.join(f['name'] for f in figures)})")
    for note in doc["summary"]["notes"]:
        print(f"  {note}")
    if lab.name == "train":
        for opt in lab.size(args.quick)["optimizers"]:
            print(f"  trained model: {out / 'models' / opt} (use it with --model {out / 'models' / opt})")
    return 0
