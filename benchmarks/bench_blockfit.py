"""A KV cache's block found from its rows (lminvert.invert.blockfit) on SmolLM2: how often the best block is right,
and by how much it leads the next.

    python benchmarks/bench_blockfit.py                      # float32 and bfloat16, blocks 1, 2, 8, 15, 29, 30

Cases: the held-out texts (``heldout.HELD_OUT``), 20 tokens, one prompt per file; each block's cache as transformers
stores it (``model(..., use_cache=True).past_key_values.layers[b - 1]``, keys after the rotary embedding, then values),
scored against the model's KV signature in its dtype (built first, timed). Prints per dtype and block the right calls,
wrong calls (a decisive wrong block: must be 0), refusals, and the smallest lead of a right call over the next block.
"""

from __future__ import annotations

import argparse
import time

import torch

import lminvert
from heldout import HELD_OUT
from lminvert.errors import LminvertError
from lminvert.invert.blockfit import kv_signature, resolve_block
from lminvert.invert.sources import Float


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--blocks", default="1,2,8,15,29,30")
    parser.add_argument("--length", type=int, default=20)
    args = parser.parse_args()
    wrong_in_all = 0
    for dtype in args.dtypes.split(","):
        model = lminvert.load_model(args.model, dtype=dtype)
        start = time.perf_counter()
        kv_signature(model)
        print(f"{args.model} {dtype}: KV signature {time.perf_counter() - start:.1f} s (0 if it was cached)")
        prompts = [list(model.tokenize(t, args.length)) for t in HELD_OUT]
        caches = []
        with torch.no_grad():
            for ids in prompts:
                caches.append(model.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values)
        for block in (int(b) for b in args.blocks.split(",")):
            right = wrong = refused = 0
            leads = []
            for cache in caches:
                entry = cache.layers[block - 1]
                rows = torch.cat(
                    [entry.keys[0].transpose(0, 1).flatten(1), entry.values[0].transpose(0, 1).flatten(1)], -1
                )
                try:
                    found, fit = resolve_block(model, [rows.float()], Float())
                except LminvertError:
                    refused += 1
                    continue
                ranked = fit.ranked
                right += int(found) == block
                wrong += int(found) != block
                leads.append(fit.scores[ranked[1]] - fit.scores[ranked[0]])
            wrong_in_all += wrong
            least = f"{min(leads):.3g}" if leads else "-"
            print(
                f"  block {block:>2}: right {right}/{len(caches)}, wrong {wrong}, refused {refused}, least lead {least}"
            )
    return 1 if wrong_in_all else 0


if __name__ == "__main__":
    raise SystemExit(main())
