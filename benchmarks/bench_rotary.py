"""How far a half model cast whole after loading (``model.to(torch.bfloat16)``: its rotary embedding's frequencies
rounded too) computes from lminvert's half model (as ``from_pretrained(..., dtype=torch.bfloat16)`` builds it: the
frequencies float32), against the ``float`` error model's bound at the same layers.

Per layer: the largest relative disagreement ``||cast - h|| / ||h||`` over the positions of each range of one long
prompt (the held-out texts joined), and the bound the ``float`` source puts on a later position
(``SAFETY * max(rest, FLOOR)``, relative to the state's norm). A disagreement under the bound means such captures are
judged within the error model (``confident`` at best, never ``certified``: they are not reproduced bit for bit).

    python benchmarks/bench_rotary.py --layers 1,15,29 --length 320
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import lminvert
from heldout import DEEP, FRESH
from lminvert.invert.layouts import foreign_calibration
from lminvert.invert.tolerance import FLOOR, SAFETY

RANGES = ((1, 10), (10, 40), (40, 100), (100, None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="1,15,29")
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args()
    model = lminvert.load_model("smollm2-135m", dtype=args.dtype)
    cast = copy.deepcopy(model.model)
    for name, buffer in list(cast.named_buffers()):  # what .to(dtype) does to the buffers lminvert keeps float32
        if buffer.is_floating_point() and buffer.dtype != model.probe.dtype:
            owner, _, leaf = name.rpartition(".")
            setattr(cast.get_submodule(owner), leaf, buffer.to(model.probe.dtype))
    ids = torch.tensor([model.tokenize(" ".join((*DEEP, *FRESH)), args.length)])
    with torch.no_grad():
        ours, theirs = (m(ids, output_hidden_states=True).hidden_states for m in (model.model, cast))
    cuts = [f"{a}-{b or ids.shape[1]}" for a, b in RANGES]
    print(f"| layer | {' | '.join(f'positions {c}' for c in cuts)} | the float bound |")
    print(f"|---|{'---|' * len(cuts)}---|")
    for layer in (int(x) for x in args.layers.split(",")):
        h, g = ours[layer][0].double(), theirs[layer][0].double()
        rel = (g - h).norm(dim=1) / h.norm(dim=1)
        bound = SAFETY * max(foreign_calibration(model, model.probe.layer(layer)).rest, FLOOR)
        cells = " | ".join(f"{100 * float(rel[a:b].max()):.2f}%" for a, b in RANGES)
        print(f"| {layer} | {cells} | {100 * bound:.1f}% |", flush=True)
    print(f"SmolLM2 in {args.dtype}, one prompt of {ids.shape[1]} tokens; torch {torch.__version__}, cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
