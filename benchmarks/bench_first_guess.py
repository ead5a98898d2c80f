"""How often the proposals' first guesses are right: the next-token prior's, the reading map's, either, by kind.

    python benchmarks/bench_first_guess.py 1,15,30

4 held-out prompts of 20 tokens of each kind (positions 1-19; position 0 is the first-position table's), SmolLM2.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import prompt_states
from lminvert.invert.proposal import NextTokenPrior
from lminvert.invert.reading import reading_map, reading_orders


def main() -> None:
    model = lminvert.load_model("smollm2-135m")
    prompts = evaluation_prompts(model, 4, 20, 0)
    for number in [int(x) for x in sys.argv[1].split(",")]:
        layer = model.probe.layer(number)
        observed = [s[layer] for s in prompt_states(model, [list(p.ids) for p in prompts], [layer], progress=False)]
        weights = reading_map(model, layer)
        prior = NextTokenPrior(model, layer, observed, depth=1)
        counts: dict[str, list[int]] = {}
        for i, (p, states) in enumerate(zip(prompts, observed, strict=True)):
            read = reading_orders(model, weights, states, 1)[1:, 0].tolist()
            for t in range(1, len(p.ids)):
                guess, seen = int(prior.orders(t)[i, 0]), read[t - 1]
                row = counts.setdefault(p.kind, [0, 0, 0, 0])
                row[0] += 1
                row[1] += guess == p.ids[t]
                row[2] += seen == p.ids[t]
                row[3] += p.ids[t] in (guess, seen)
        print(
            f"layer {number}: "
            + ", ".join(
                f"{kind} prior {r[1] / r[0]:.2f} reading {r[2] / r[0]:.2f} either {r[3] / r[0]:.2f} (n={r[0]})"
                for kind, r in counts.items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
