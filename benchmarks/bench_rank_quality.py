"""How well each ranking places the true token: its rank under the secant fit (from N random candidates verified
at the position), under an output-weighted variant of it, and under the model's own next-token prior.

    python benchmarks/bench_rank_quality.py 30 256 20     # layer, random candidates per position, positions
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch

import lminvert
from evalset import evaluation_prompts
from lminvert.forward import encode
from lminvert.invert.secant import centre, fit_secant_map

m = lminvert.load_model("smollm2-135m")
probe = m.probe
layer = probe.layer(int(sys.argv[1]))
n = int(sys.argv[2])
npos = int(sys.argv[3])
E = probe.vocab_matrix().double()
ps = evaluation_prompts(m, 1, 20, 0)
gen = torch.Generator().manual_seed(0)
res = {"plain": [], "weighted": [], "lm": []}
for p in ps:
    st = encode(m, [list(p.ids)], layer).states[0]
    prefix = probe.prefix([], layer)
    prefix = probe.extend(prefix, p.ids[0])
    full = probe.prefix([], -1)
    full, last = probe.advance(full, p.ids[0])
    for t in range(1, npos):
        target = st[t].double()
        ids = torch.randint(0, probe.vocab_size, (n,), generator=gen)
        with torch.no_grad():
            h = probe.continuation(prefix, token_ids=ids).double()
        keep = h.norm(dim=1) <= 4 * target.norm()
        x, hc = centre(E[ids][keep], h[keep])
        J = fit_secant_map(x, hc, ridge=1e-3)
        P = E @ J
        offset = (h[keep] - P[ids[keep]]).mean(0)
        r = target - offset
        true = p.ids[t]
        score = (P - r).square().sum(1)
        res["plain"].append(int((score < score[true]).sum()))
        resid = (h[keep] - offset) - P[ids[keep]]
        w = 1.0 / resid.var(0).clamp_min(1e-12)
        score_w = ((P - r).square() * w).sum(1)
        res["weighted"].append(int((score_w < score_w[true]).sum()))
        logits = probe.next_token_logits(last)
        res["lm"].append(int((logits > logits[true]).sum()))
        prefix = probe.extend(prefix, true)
        full, last = probe.advance(full, true)
    print(p.kind, {k: v[-(npos - 1) :] for k, v in res.items()}, flush=True)
for k, v in res.items():
    top16, top64 = sum(x < 16 for x in v) / len(v), sum(x < 64 for x in v) / len(v)
    mean = sum(v) / len(v)
    print(f"{k}: median rank {statistics.median(v)}, mean {mean:.0f}, top-16 {top16:.2f}, top-64 {top64:.2f}")
