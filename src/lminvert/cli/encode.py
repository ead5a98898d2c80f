"""`lminvert encode`: write the layer-L states of prompts to a safetensors file."""

from __future__ import annotations

import argparse

from ..corpora import read_prompts_file
from ..errors import LminvertError
from ..forward import encode
from ..paths import check_output_file
from .common import add_command, add_model_args, model_from_args, print_json

EXAMPLES = """examples:
  lminvert encode --layer 15 --text "My card number is 4111 1111 1111 1111" --out leak.safetensors
  lminvert encode --model gpt2-small-random --layer -1 --file prompts.txt --max-tokens 20 --out s.safetensors
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "encode", "prompts -> hidden-states file", __doc__, EXAMPLES)
    add_model_args(parser)
    parser.add_argument("--layer", required=True, help="0 (embeddings) .. L, negative from the top, or 'final'")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a prompt (repeat for several)")
    source.add_argument("--file", help='.txt (one prompt per line) or .jsonl (a "text" field)')
    parser.add_argument("--max-tokens", type=int, default=None, help="truncate each prompt to N tokens")
    parser.add_argument("--keep-ids", action="store_true", help="also store the token ids (off: a leak has none)")
    parser.add_argument("--out", required=True, help="output .safetensors path")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise LminvertError("--max-tokens must be at least 1")
    check_output_file(args.out, ".safetensors")
    prompts = args.text if args.text else read_prompts_file(args.file)
    model = model_from_args(args)
    model.probe.layer(args.layer)  # fail fast on a bad layer
    states = encode(model, prompts, args.layer, max_tokens=args.max_tokens, keep_ids=True, progress=True)
    ids = states.token_ids or ()
    if not args.keep_ids:
        states = states.with_meta(token_ids=None)
    path = states.save(args.out)
    if args.json:
        print_json(
            {
                "model": model.name,
                "layer": states.layer,
                "out": str(path),
                "prompts": [{"token_ids": list(p), "n_tokens": len(p)} for p in ids],
            }
        )
    else:
        print(
            f"wrote {path}: {len(states)} prompt(s), {sum(states.lengths)} tokens, layer {states.layer} of "
            f"{model.name} (d={states.hidden_size}, {states.dtype}, weights {model.weights_hash})"
            + ("" if args.keep_ids else "; token ids not stored")
        )
    return 0
