"""What a CUDA graph would save per forward, measured before the engine uses one: one verification-shaped forward
(``--batch`` candidates of one token each after a 20-token prefix, every block of the model, no head) run three
ways and timed (the mean of 20 calls after one; 50 replays for the graph):

* eager over transformers' dynamic cache, as lminvert's engine runs it (the cache cut back after each call);
* eager over a static cache (:class:`transformers.StaticCache`, the slot after the prefix written each call);
* that static forward captured once as a CUDA graph and replayed (``--device cuda`` only).

Printed: each way's milliseconds and the largest difference of the static and replayed states from the dynamic
ones. A probe, not a mechanism: nothing here decides a token.

    python benchmarks/probe_graphs.py --device cuda --batch 128
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

import torch
from transformers import StaticCache

import lminvert
from lminvert.errors import LminvertError

PREFIX = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=128, help="candidates in the forward")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch takes 1 or more candidates, not {args.batch}")
    try:
        model = lminvert.load_model(args.model, dtype="float32", device=args.device)
    except LminvertError as exc:
        parser.error(str(exc))
    base = getattr(model.probe.model, "model", model.probe.model)
    vocab = model.probe.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, PREFIX), generator=gen).expand(args.batch, PREFIX).contiguous()
    prefix, cand = prefix.to(args.device), torch.randint(0, vocab, (args.batch, 1), generator=gen).to(args.device)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn: Callable[[], object], calls: int) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls * 1000

    with torch.no_grad():
        dynamic = base(prefix, use_cache=True).past_key_values

        def eager() -> torch.Tensor:
            out = base(cand, past_key_values=dynamic, use_cache=True).last_hidden_state
            dynamic.crop(-1)
            return out

        ref = eager()
        print(f"batch {args.batch}, {args.device}: eager, dynamic cache {timed(eager, 20):.2f} ms", flush=True)
        static_cache = StaticCache(config=base.config, max_cache_len=PREFIX + 1)
        base(prefix, past_key_values=static_cache, use_cache=True)

        def static() -> torch.Tensor:
            for layer in static_cache.layers:  # the slot after the prefix, every call (a replay repeats this too)
                layer.cumulative_length.fill_(PREFIX)
            return base(cand, past_key_values=static_cache, use_cache=True).last_hidden_state

        diff = float((static() - ref).abs().max())
        print(f"eager, static cache {timed(static, 20):.2f} ms (max |diff| from dynamic {diff:.3g})", flush=True)
        if not cuda:
            return
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    static()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = static()
            graph.replay()
            sync()
            diff = float((out - ref).abs().max())
            print(f"CUDA graph replay {timed(graph.replay, 50):.2f} ms (max |diff| from dynamic {diff:.3g})")
        except RuntimeError:
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
