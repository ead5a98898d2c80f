"""The same inversions under two versions of lminvert: run once per version, alternating, and compare the lines.

    git worktree add /tmp/before COMMIT
    for v in /tmp/before/src src /tmp/before/src src; do
        OMP_NUM_THREADS=1 PYTHONPATH=$v python benchmarks/bench_versions.py 1,15
    done

Prints, per layer, the median seconds per prompt, the time split summed over the prompts (ranking, verification,
prefix extension), mean candidates per position and exactness, for the first prompt of each kind of the benchmark
set (prose, code, random ids, personal), inverted one at a time after a warm-up.
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import encode
from lminvert.invert import invert


def main() -> None:
    print(lminvert.__file__)
    model = lminvert.load_model("smollm2-135m")
    prompts = evaluation_prompts(model, 1, 20, 0)
    for layer in [int(x) for x in sys.argv[1].split(",")]:
        states = encode(model, [list(p.ids) for p in prompts], layer)
        invert(model, states.with_meta(states=states.states[:1]))  # warm-up (tables, calibration, kernels)
        rows = []
        for i, p in enumerate(prompts):
            (r,) = invert(model, states.with_meta(states=states.states[i : i + 1]))
            rows.append((p.kind, r.seconds, sum(r.candidates_checked) / len(p.ids), r.token_ids == list(p.ids), r))
        split = {k: sum(row[4].time_split[k] for row in rows) for k in ("ranking", "verification", "extension")}
        print(
            f"layer {layer}: median {statistics.median(row[1] for row in rows):.2f} s, sum "
            f"{sum(row[1] for row in rows):.1f} s (ranking {split['ranking']:.1f}, verification "
            f"{split['verification']:.1f}, extension {split['extension']:.1f}), "
            f"{statistics.fmean(row[2] for row in rows):.1f} cand/pos, "
            f"exact {sum(row[3] for row in rows)}/{len(rows)}, "
            + ", ".join(f"{kind} {s:.1f} s {c:.0f} c/p" for kind, s, c, _, _ in rows),
            flush=True,
        )


if __name__ == "__main__":
    main()
