"""Layer found from the states (lminvert.invert.layerfit) on SmolLM2: how often the best layer is right, by how much
it leads, and the spread that tells states of this model from random numbers.

    python benchmarks/bench_layerfit.py

Cases: 5 texts and 4 random-id prompts of 20 tokens at every layer (0..30 and final), computed by a float32 and a
bfloat16 model and scored against the float32 model's signature; the first text with relative noise 1e-3..1e-1
(modelled with its noise source, and not); Gaussian random arrays [20, 576] of scales 0.03 to 10^4. Prints per case
the wrong calls, the largest lead of a wrong call, the right calls' leads (min, 10th percentile, median, share at
least MARGIN) and the largest spread. Last, windows cut from those prompts (rows from position 3 or 8 on) at every
layer, with ``--layer`` given and without, beside the whole prompts: what :func:`resolve_layer` does with each (named
a window, another one-line error, searched at the right layer, searched at another), by layer.
"""

from __future__ import annotations

import time

import torch

import lminvert
from lminvert.errors import LminvertError
from lminvert.invert.layerchoice import resolve_layer
from lminvert.invert.layerfit import FIT, MARGIN, fit_layers, signature
from lminvert.invert.sources import Noise
from lminvert.invert.tolerance import add_noise

TEXTS = [
    "Contact Jane Doe at jane.doe@example.com about invoice 4471.",
    "The meeting moved to Thursday at 3pm in room B.",
    "def add(a, b): return a + b",
    "Please reset my password, the old one was hunter2 and it expired.",
    "Bonjour, je voudrais réserver une table pour deux personnes.",
]


def report(model, tag: str, cases) -> None:
    wrong, wrong_leads, leads, spread = 0, [0.0], [], 0.0
    for truth, states, source in cases:
        fit = fit_layers(model, [states], source)
        ranked = fit.ranked
        lead = fit.scores[ranked[1]] - fit.scores[ranked[0]]
        if fit.best != truth:
            wrong += 1
            wrong_leads.append(lead)
        else:
            leads.append(lead)
        spread = max(spread, fit.fit)
    g = torch.tensor(leads or [0.0])
    print(
        f"{tag:<28} cases {len(cases):>4}  wrong {wrong:>2} (largest lead {max(wrong_leads):7.3g})  right leads: min "
        f"{g.min():7.3g} p10 {g.quantile(0.1):7.3g} median {g.median():7.3g} "
        f">= {MARGIN:g}: {(g >= MARGIN).float().mean():.2f}"
        f"  largest spread {spread:.3g}"
    )


def main() -> None:
    model = lminvert.load_model("smollm2-135m")
    start = time.perf_counter()
    signature(model)
    print(f"signature: {time.perf_counter() - start:.1f} s (0 s when cached); MARGIN {MARGIN:g}, FIT {FIT:g}")
    layers = [*range(model.probe.n_layers + 1), "final"]
    gen = torch.Generator().manual_seed(9)
    for dtype in ("float32", "bfloat16"):
        m = model if dtype == "float32" else lminvert.load_model("smollm2-135m", dtype=dtype)
        cases = []
        for text in TEXTS:
            states = m.probe.states(torch.tensor([m.tokenize(text)]), layers)
            cases += [(layer.name, s[0].float(), None) for layer, s in states.items()]
        report(model, f"{dtype} texts", cases)
        ids = torch.randint(0, m.probe.vocab_size, (4, 20), generator=gen)
        states = m.probe.states(ids, layers)
        report(
            model, f"{dtype} random ids", [(k.name, s[i].float(), None) for k, s in states.items() for i in range(4)]
        )
    states = model.probe.states(torch.tensor([model.tokenize(TEXTS[0])]), layers)
    for sigma in (1e-3, 1e-2, 3e-2, 1e-1):
        for modelled in (True, False):
            src = Noise(sigma=sigma) if modelled else None
            cases = [(k.name, add_noise(s[0], sigma, gen), src) for k, s in states.items()]
            report(model, f"noise {sigma:g}{'' if modelled else ' unmodelled'}", cases)
    for scale in (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 1e4):
        noise = [scale * torch.randn(20, 576, generator=gen)]
        fit = fit_layers(model, noise)
        try:
            resolve_layer(model, noise, None)
            verdict = "ACCEPTED"
        except LminvertError as exc:
            said = str(exc)
            verdict = "refused: " + ("far from every embedding" if "embedding" in said else said[:40])
        print(f"random numbers x {scale:<6g} closest {fit.describe()}: {verdict}")
    windows(model, layers, gen)


def windows(model, layers: list, gen: torch.Generator) -> None:
    """What resolve_layer does with whole prompts and with windows cut from them (module docstring)."""
    ids = [torch.tensor(model.tokenize(text)) for text in TEXTS]
    ids += list(torch.randint(0, model.probe.vocab_size, (4, 20), generator=gen))
    counts: dict[tuple[str, str, str], int] = {}
    for prompt in ids:
        for layer, rows in model.probe.states(prompt[None], layers).items():
            band = "12-28" if 12 <= int(layer) <= 28 else "other layers"
            for what, cut in (("whole", rows[0]), ("window from 3", rows[0, 3:]), ("window from 8", rows[0, 8:])):
                for given in (layer, None):
                    try:
                        got = "right layer" if resolve_layer(model, [cut], given)[0] == layer else "another layer"
                    except LminvertError as exc:
                        got = "named a window" if "later position on" in str(exc) else "another error"
                    key = (what, band, got)
                    counts[key] = counts.get(key, 0) + 1
    for (what, band, got), n in sorted(counts.items()):
        print(f"{what:>14} at layers {band:<12} (--layer given and not): {got:<14} {n}")


if __name__ == "__main__":
    main()
