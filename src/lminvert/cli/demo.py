"""`lminvert demo`: the main job on the default model, end to end, offline.

1. a prompt with personal data is encoded at a middle layer into a states file (what leaks);
2. the states file alone is inverted back to the exact token ids (SIPIT), with time and margins;
3. a small collision search over a few hundred prompts writes its table and figure.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

from ..collisions import CollisionResults, find_collisions
from ..errors import LminvertError
from ..forward import encode
from ..invert import invert
from ..models import DEFAULT_LAYERS, LoadedModel
from ..paths import check_output_dir
from ..report import render
from ..states import HiddenStates
from .common import add_command, add_model_args, model_from_args

log = logging.getLogger(__name__)

SAMPLE = "Hi, I'm Alice Smith and my card number is 4111 1111 1111 1111."

EXAMPLES = """examples:
  lminvert demo                                           # smollm2-135m at layer 15, files in out/demo
  lminvert demo --model tiny-llama --layer 1 --n-prompts 50 --out runs/demo-tiny
  lminvert demo --text "my IBAN is DE89 3704 0044 0532 0130 00" --device cuda --out runs/demo-iban
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "demo", "run the end-to-end demo on the default model", __doc__, EXAMPLES, defaults=False)
    add_model_args(parser)
    parser.add_argument("--out", default="out/demo", help="directory for the demo's files")
    parser.add_argument("--layer", default="15", help="layer to encode and invert at")
    parser.add_argument("--text", default=SAMPLE, help="the prompt to leak and recover")
    parser.add_argument("--n-prompts", type=int, default=300, help="prompts in the collision search")
    parser.set_defaults(func=run)


def demo_collisions(
    model: LoadedModel, out_dir: str | Path, n_prompts: int = 300, progress: bool = False
) -> tuple[CollisionResults, dict[str, str]]:
    """A small collision search (first, middle and last block; 16-token windows of the mixed corpus), rendered.

    A rerun with the same settings reuses ``out_dir``; one with other settings replaces the demo run found there.
    """
    settings = dict(corpus="mixed", n_prompts=n_prompts, layers=DEFAULT_LAYERS, max_tokens=16, seed=0)
    try:
        results = find_collisions(model, out=out_dir, progress=progress, **settings)
    except LminvertError as exc:
        if "different collisions run" not in str(exc):
            raise
        log.info("%s held a demo run with other settings; replacing it", out_dir)  # the demo's own directory
        shutil.rmtree(out_dir)
        results = find_collisions(model, out=out_dir, progress=progress, **settings)
    return results, render(results)


def run(args: argparse.Namespace) -> int:
    if args.n_prompts < 2:
        raise LminvertError("--n-prompts must be at least 2")
    out = check_output_dir(args.out)
    start = time.perf_counter()
    model = model_from_args(args)
    info = model.describe()
    print(
        f"model     {model.name}: {info['architecture']}, {info['n_layers']} layers, d={info['hidden_size']}, "
        f"|V|={info['vocab_size']}, {info['dtype']} on {info['device']}, weights {info['weights_hash']} "
        f"({time.perf_counter() - start:.1f} s to load)"
    )

    print("\n1. leak: encode a prompt at a middle layer")
    path = encode(model, [args.text], args.layer).save(out / "leak.safetensors")
    leaked = HiddenStates.load(path)
    print(f"   prompt  {args.text!r}")
    print(
        f"   wrote   {path}: layer {leaked.layer}, {leaked.lengths[0]} positions x {leaked.hidden_size} floats, "
        "no text, no token ids"
    )

    print("\n2. invert: recover the exact prompt from the states file alone")
    (result,) = invert(model, leaked, progress=True)
    truth = model.tokenize(args.text)
    exact = result.token_ids == truth
    print(f"   recovered {result.text!r}")
    right = sum(a == b for a, b in zip(result.token_ids, truth, strict=False))
    print(
        f"   {'EXACT' if exact else 'NOT exact'}: {right}/{len(truth)} "
        f"tokens in {result.seconds:.1f} s; {sum(result.candidates_checked)} candidates verified "
        f"({100 * result.explored_fraction:.2f}% of the vocabulary per position)"
    )
    ratios = [m / max(d, 1e-30) for m, d in zip(result.margins, result.distances, strict=True) if m != float("inf")]
    rejected = f"; nearest rejected candidate >= {min(result.margins):.2f}" if ratios else ""
    print(
        f"   accepted distances <= {max(result.distances):.2e}{rejected}"
        + (f" (margin/distance >= {min(ratios):.0e})" if ratios else "")
        + (f"; uncertain: {result.uncertain_positions}" if result.uncertain_positions else "")
    )
    print("   verdicts: " + ", ".join(f"{n} {v}" for v, n in result.verdict_counts.items() if n))

    print(f"\n3. collisions: minimum pairwise distance of {args.n_prompts} prompts' last-token states")
    res, paths = demo_collisions(model, out / "collisions", n_prompts=args.n_prompts, progress=True)
    for name, layer in res.layers.items():
        print(
            f"   layer {name:>3}: min distance {layer.min_distance:.4f} over {res.n_pairs:,} pairs, "
            f"{layer.n_below_threshold} below {res.config.threshold:g}"
        )
    print(f"   table   {paths['markdown']}\n   figure  {paths['figure']}")
    print(f"\ndone in {time.perf_counter() - start:.0f} s")
    return 0 if exact else 1
