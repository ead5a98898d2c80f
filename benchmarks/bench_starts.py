"""Prompts as people begin them, without a BOS token: lminvert's own states of each, inverted under a time bound; a
prompt counts where every token is right and every position ``certified`` or ``confident``.

The default set is 15 openings of records and messages ("Patient John Doe was admitted", "Dear John, thank you
for", ...), cut to ``--tokens``; ``--corpus NAME --prompts N --seed S`` draws windows of a bundled corpus instead
(``lminvert.corpora.sample_prompts``). Found with it: 'Patient John Doe,' at layer 15, whose position 1's cached state
lies 29 times the calibrated radius from the observation (docs/results.md).

    python benchmarks/bench_starts.py --layer 15 --seconds 30
    python benchmarks/bench_starts.py --layer 15 --corpus records --prompts 80 --tokens 8 --seed 11

Exit status 1 where a wrong token is claimed certified or confident.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import lminvert
from lminvert.corpora import sample_prompts

OPENINGS = (
    "Patient John Doe was admitted",
    "Doctor Smith said that the",
    "Customer Jane Roe called about",
    "Employee ID 4471 badge expired",
    "User Alice reset her password",
    "Mr Brown paid the invoice",
    "Sergeant Miller filed the report",
    "Client Acme Corp signed the",
    "Subject: quarterly results for",
    "Dear John, thank you for",
    "Password reset for account admin",
    "Name: Maria Lopez, DOB",
    "Hello world from the server",
    "Professor Chen will lecture on",
    "Nurse Kelly gave the patient",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=6, help="each prompt cut to this many tokens")
    parser.add_argument("--seconds", type=float, default=30.0, help="each inversion's time bound")
    parser.add_argument("--corpus", default=None, help="draw windows of this corpus instead of the openings")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = lminvert.load_model(args.model)
    if args.corpus is None:
        prompts = [model.tokenize(text)[: args.tokens] for text in OPENINGS]
    else:
        drawn, _ = sample_prompts(model.tokenizer, args.corpus, args.prompts, args.tokens, args.seed, args.tokens)
        prompts = [list(p.ids) for p in drawn]
    good, wrong, times = 0, 0, []
    for ids in prompts:
        states = lminvert.encode(model, [ids], args.layer)
        start = time.perf_counter()
        (result,) = lminvert.invert(model, states, args.layer, max_seconds=args.seconds)
        times.append(time.perf_counter() - start)
        sure = [p.verdict in ("certified", "confident") for p in result.positions]
        right = [a == b for a, b in zip(result.token_ids, ids, strict=True)]
        wrong += sum(s and not r for s, r in zip(sure, right, strict=True))
        good += all(sure) and all(right)
        verdict = "ok " if all(sure) and all(right) else "MISSED"
        print(f"{times[-1]:7.2f} s  {verdict}  {sum(right)}/{len(ids)} right, {sum(sure)} sure  {model.decode(ids)!r}")
    print(
        f"{args.model} layer {args.layer}, {args.tokens} tokens: {good}/{len(prompts)} every token right and sure; "
        f"median {statistics.median(times):.2f} s, slowest {max(times):.1f} s, sum {sum(times):.1f} s; "
        f"wrong claimed {wrong}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
