"""One command on one leak: KV caches captured by transformers and defended states, inverted through
:func:`lminvert.invert` (the route ``lminvert invert FILE --leak kv|--source ...`` takes), on held-out prompts.

Each cell is ``LEAK:LAYER:DTYPE[:SOURCE]``: ``kv:15:float32`` is block 15's cache as ``model(**batch,
use_cache=True).past_key_values.layers[14]`` holds it (keys after the rotary embedding, then values); ``states:15:
float32:quant:int8`` is transformers' ``hidden_states[15]`` quantised per row (absmax int8), inverted with
``source="quant:int8"``. Every cell's prompts also run as a plain states leak of the same layer (``source="float"``,
the engine) in the same process: the ``x states`` column is the cell's median over that one's.

Printed per cell: tokens right, prompts exact, positions ``certified``/``confident``, tokens claimed certified or
confident that are wrong (must be 0), median and slowest seconds per prompt. This CPU unless ``--device``.

    python benchmarks/bench_leaks.py                       # the default cells, 6 prompts of 20 tokens
    python benchmarks/bench_leaks.py --cells kv:15:float32 --prompts 2
    python benchmarks/bench_leaks.py --set fresh --prompts 8 --cells states:30:float32:noise:0.01
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import lminvert
from heldout import FRESH, HELD_OUT
from lminvert.invert.sources import Quant
from lminvert.invert.tolerance import add_noise
from lminvert.states import HiddenStates

DEFAULT_CELLS = (
    "kv:1:float32,kv:15:float32,kv:30:float32,kv:1:bfloat16,kv:15:bfloat16,kv:30:bfloat16,"
    "states:15:float32:quant:int8,states:15:float32:noise:0.01,states:15:float32:noise:0.03,states:15:float32:quant:int4"
)
CLAIMED = ("certified", "confident")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", choices=("held_out", "fresh"), default="held_out", help="the texts: heldout.HELD_OUT or FRESH"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    texts = HELD_OUT if args.set == "held_out" else FRESH
    if args.prompts > len(texts):  # refused before any model is loaded
        parser.error(f"--prompts {args.prompts}: --set {args.set} holds {len(texts)} texts")
    torch.manual_seed(args.seed)
    models: dict[str, lminvert.LoadedModel] = {}
    cells = [cell.split(":") for cell in args.cells.split(",")]
    for cell, (leak, layer, dtype, *_) in zip(args.cells.split(","), cells, strict=True):  # every cell before any runs
        if dtype not in models:
            models[dtype] = lminvert.load_model(args.model, dtype=dtype, device=args.device)
        if leak == "states" and int(layer) >= models[dtype].probe.n_layers:  # transformers' last is after the norm
            parser.error(f"{cell}: hidden_states[{layer}] is the final norm's output; cells take layers below it")
    report = []
    head = f"{'cell':34} {'tokens':>9} {'exact':>6} {'sure':>6} {'wrong':>5} {'median s':>8} {'max s':>7}"
    print(f"{head} {'x states':>8}")
    for cell, (leak, layer, dtype, *rest) in zip(args.cells.split(","), cells, strict=True):
        source = ":".join(rest) or None
        model = models[dtype]
        prompts = [list(model.tokenize(t, args.length)) for t in texts[: args.prompts]]
        row = _cell(model, leak, int(layer), source, prompts, args.seed)
        row["cell"] = cell
        report.append(row)
        print(
            f"{cell:34} {row['right']:>4}/{row['tokens']:<4} {row['exact']:>3}/{len(prompts):<2} "
            f"{100 * row['sure'] / row['tokens']:>5.1f}% {row['wrong_claimed']:>5} {row['median']:>8.2f} "
            f"{row['max']:>7.2f} {row['median'] / row['states_median']:>8.2f}",
            flush=True,
        )
    print(f"device: {report and report[0]['device']}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if all(r["wrong_claimed"] == 0 for r in report) else 1


def _capture(model, ids: list[int], leak: str, layer: int, source: str | None, seed: int) -> torch.Tensor:
    """What a transformers user holds: ``hidden_states[layer]`` or the block's cache entries, defended by ``source``."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids], device=model.probe.device), use_cache=True,
                          output_hidden_states=True)  # fmt: skip
    if leak == "kv":
        entry = out.past_key_values.layers[layer - 1]
        keys, values = entry.keys[0], entry.values[0]  # [heads, T, head_dim]
        return torch.cat([keys.transpose(0, 1).flatten(1), values.transpose(0, 1).flatten(1)], -1).cpu()
    states = out.hidden_states[layer][0].cpu()
    if source is None:
        return states
    kind, value = source.split(":")
    if kind == "noise":
        return add_noise(states.float(), float(value), torch.Generator().manual_seed(seed + sum(ids)))
    return Quant(kind=value).quantise(states.float())


def _run(model, rows: torch.Tensor, leak: str, layer: int, source: str | None):
    start = time.perf_counter()
    result = lminvert.invert(model, HiddenStates.from_array(rows), layer, leak=leak, source=source or "float")[0]
    return result, time.perf_counter() - start


def _cell(model, leak: str, layer: int, source: str | None, prompts: list[list[int]], seed: int) -> dict:
    right = exact = sure = wrong = 0
    seconds, states_seconds = [], []
    states_layer = layer - 1 if leak == "kv" else layer  # the states the cache is computed from
    warm = prompts[0][:4]  # tables, calibrations and radii made once, untimed (kept on disk: a second run reads them)
    _run(model, _capture(model, warm, leak, layer, source, seed), leak, layer, source)
    _run(model, _capture(model, warm, "states", states_layer, None, seed), "states", states_layer, None)
    for ids in prompts:
        result, took = _run(model, _capture(model, ids, leak, layer, source, seed), leak, layer, source)
        hits = [a == b for a, b in zip(result.token_ids, ids, strict=True)]
        right += sum(hits)
        exact += all(hits)
        sure += sum(v in CLAIMED for v in result.verdicts)
        wrong += sum(v in CLAIMED and not h for v, h in zip(result.verdicts, hits, strict=True))
        seconds.append(took)
        _, base = _run(model, _capture(model, ids, "states", states_layer, None, seed), "states", states_layer, None)
        states_seconds.append(base)
    return {
        "tokens": sum(map(len, prompts)), "right": right, "exact": exact, "sure": sure, "wrong_claimed": wrong,
        "median": statistics.median(seconds), "max": max(seconds), "seconds": seconds,
        "states_median": statistics.median(states_seconds), "device": f"{model.probe.device} ({model.dtype})",
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
