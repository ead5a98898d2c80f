"""States of a "fine-tuned copy" of the default model, inverted with the model itself: how long until an answer, and
what it says. The copy adds Gaussian noise of 1e-3 of each block weight's spread (what a short fine-tune changes);
its layer-15 states fit layer 15, and the search must end in seconds with every position uncertain and a note, never
a confident token.

    python benchmarks/bench_finetuned.py
"""

from __future__ import annotations

import copy
import time

import torch

import lminvert
from lminvert.invert import invert

TEXTS = ["My password is hunter2, do not share.", "Contact Jane Doe at jane.doe@example.com about invoice 4471."]
SPREAD = 1e-3  # the copy's change, relative to each block weight's standard deviation
LAYER = 15


def main() -> None:
    model = lminvert.load_model("smollm2-135m")
    tuned = copy.deepcopy(model.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in tuned.named_parameters():
            if ".layers." in name:
                weight.add_(torch.randn(weight.shape, generator=gen) * SPREAD * weight.std())
    threads = torch.get_num_threads()
    print(f"{model.name} copy, block weights + N(0, ({SPREAD:g} x std)^2), layer {LAYER}, {threads} threads")
    for text in TEXTS:
        ids = model.tokenize(text)
        with torch.no_grad():
            states = tuned(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYER][0]
        start = time.perf_counter()
        (result,) = invert(model, states)
        seconds = time.perf_counter() - start
        right = sum(a == b for a, b in zip(result.token_ids, ids, strict=True))
        print(
            f"{len(ids):>3} tokens: {seconds:5.1f} s, layer {result.layer} found, {right}/{len(ids)} tokens right, "
            f"verdicts {result.verdict_counts}"
        )
        for note in result.notes:
            print(f"      note: {note[:110]}")


if __name__ == "__main__":
    main()
