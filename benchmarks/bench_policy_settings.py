"""The default policy with some settings changed, on the first prompt of each kind of the benchmark set.

    python benchmarks/bench_policy_settings.py 30 '{"norm_rank": 16}' prose,code,personal

Prints per prompt the seconds, the time split, mean candidates per position, exactness and the candidates at each
position (deterministic: compare settings by candidates on a busy machine, by seconds only on an idle one), then the
mean candidates per position over all. Settings are :class:`lminvert.invert.policies.LinearPolicy` arguments.
"""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import encode
from lminvert.invert import invert

policies = importlib.import_module("lminvert.invert.policies")


def main() -> None:
    layer = int(sys.argv[1])
    settings = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["prose", "code", "random", "personal"]

    class Variant(policies.LinearPolicy):
        def __init__(self, **kw) -> None:
            super().__init__(**{**settings, **kw})

    policies.POLICIES["linear"] = Variant
    model = lminvert.load_model("smollm2-135m")
    prompts = [p for p in evaluation_prompts(model, 1, 20, 0) if p.kind in kinds]
    states = encode(model, [list(p.ids) for p in prompts], layer)
    invert(model, states.with_meta(states=states.states[:1]))  # warm-up (tables, calibration, kernels)
    total = 0
    for i, p in enumerate(prompts):
        (r,) = invert(model, states.with_meta(states=states.states[i : i + 1]))
        counts = r.candidates_checked
        total += sum(counts)
        split = {k: round(v, 2) for k, v in r.time_split.items()}
        print(
            f"{p.kind}: {r.seconds:.2f} s {split}, {sum(counts) / len(counts):.1f} c/p, exact "
            f"{r.token_ids == list(p.ids)}, uncertain {r.uncertain_positions}, per position {counts}",
            flush=True,
        )
    print(f"layer {layer} {settings}: {total / sum(len(p.ids) for p in prompts):.1f} candidates per position")


if __name__ == "__main__":
    main()
