"""The audit on the shared runner: one unit per (leak, layer, defence), its rows one per prompt.

Each row holds what the attack recovered (tokens right, exact prompt, verdict counts, wrong tokens claimed certified or
confident: never any), the time, per position the defence's perturbation beside half the gap to the nearest other
verified candidate (Theorem 3.2's Delta/2 where the whole vocabulary was verified), and the defence's utility: the
deployment's next-token predictions computed with what it keeps, against the undefended model's on the same prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..errors import LminvertError
from ..experiments.base import Context, Experiment, Row, Unit
from ..experiments.prompts import evaluation_prompts
from ..forward import encode
from ..invert.last import LastOptions
from ..invert.rows.attack import Attack, Recovered
from ..invert.rows.calibration import calibrate_rows
from ..invert.tables import first_position_tables
from ..models import LoadedModel
from .defences import DEFAULT, parse_defence, perturbation
from .leaks import Leak, make_leak, outputs
from .summary import summarise

CLAIMED = ("certified", "confident")
# the one-vector search's budget per prompt of a ``last`` leak (the size's ``last_seconds``): at the presets' lengths
# (8 and 20 tokens) the search finds no whole prompt in any budget (docs/results.md, "One vector"), only the last token
# its first lengths read; short prompts given in a file want more (two tokens: 3-5 s at layer 1 on a 2-core CPU)
LAST_SECONDS = {"quick": 1.0, "full": 0.5}


def _key(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


def read_prompts(model: LoadedModel, path: str, length: int | None) -> list[list[int]]:
    """One prompt per non-empty line of a text file, tokenized (cut to ``length`` tokens when given)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError as err:
        raise LminvertError(
            f"cannot read prompts file {path}: {err.strerror}; give a text file, one prompt a line"
        ) from None
    if not lines:
        raise LminvertError(f"prompts file {path} holds no prompt: give a text file, one prompt a line")
    return [list(model.tokenize(line, length)) for line in lines]


def utility(
    leak: Leak, token_ids: list[int], before: torch.Tensor, clean: torch.Tensor, kept: torch.Tensor
) -> dict[str, float | None]:
    """Top-1 agreement with the undefended model (its outputs ``before``, from the ``clean`` rows) and the change in
    next-token loss (where the prompt holds the next token), the deployment computing with ``kept``."""
    after = before if torch.equal(kept, clean) else outputs(leak, token_ids, kept)
    top1 = float((after.argmax(-1) == before.argmax(-1)).double().mean())
    if leak.name == "last" or len(token_ids) < 2:
        return {"top1": top1, "dloss": None}
    targets = torch.tensor(token_ids[1:])
    loss = [torch.nn.functional.cross_entropy(x[:-1].double(), targets) for x in (before, after)]
    return {"top1": top1, "dloss": float(loss[1] - loss[0])}


def _row(token_ids: list[int], found: Recovered) -> Row:
    """What one prompt's attack recovered, position by position. A ``last`` leak's (one vector: the last position's
    state) is aligned at the end: a whole prompt of the same length compared position by position, a shorter one's
    tokens (a last token's guess, route ``last-table``) with the prompt's last ones, a longer one's extra tokens
    wrong."""
    offset = len(token_ids) - len(found.token_ids) if found.route.startswith("last") else 0
    right = [0 <= offset + i < len(token_ids) and t == token_ids[offset + i] for i, t in enumerate(found.token_ids)]
    claimed = [v in CLAIMED for v in found.verdicts]
    return {
        "length": len(token_ids),
        "recovered": found.token_ids,
        "right": sum(right),
        "exact": found.token_ids == token_ids,
        "positions": [offset + i for i in range(len(found.token_ids))],
        "verdicts": {v: found.verdicts.count(v) for v in ("certified", "confident", "uncertain")},
        "wrong_claimed": sum(c and not r for c, r in zip(claimed, right, strict=True)),
        "seconds": found.seconds,
        "checked_mean": sum(found.checked) / max(len(found.checked), 1),
        "half_gap": [None] if found.route == "last" else found.half_gaps,  # one vector: one row shipped, no gap
        "route": found.route,
    }


class Audit(Experiment):
    name = "audit"
    title = "Audit: what leaks from states, a KV cache or an embedding, at each layer, under each defence"
    paper = (
        "Published attacks each answer one case: permuting hidden dimensions is broken by vocabulary matching "
        "(Hidden No More, ICML 2025, whose attack stops at about 1% Gaussian noise); a KV cache is inverted "
        "essentially perfectly without a defence (Shadow in the Cache, NDSS 2026)."
    )
    quick_size: ClassVar[dict[str, Any]] = {
        "prompts": 2, "length": 8, "kinds": ["prose", "chat"], "layers": [1, "middle"],
        "leaks": ["states", "kv", "last"], "prompts_file": None,
        "defences": ["none", "noise:0.01", "permute", "project:128"], "last_seconds": LAST_SECONDS["quick"],
    }  # fmt: skip
    full_size: ClassVar[dict[str, Any]] = {
        "prompts": 20, "length": 20, "kinds": ["prose", "chat"], "layers": [1, "middle", -1],
        "leaks": ["states", "kv", "last"], "defences": list(DEFAULT), "prompts_file": None,
        "last_seconds": LAST_SECONDS["full"],
    }  # fmt: skip
    full_duration = (
        "about two hours on SmolLM2 on a 2-core CPU (estimated from all 90 cells run on 2 of the 20 prompts, one prose "
        "and one chat: 16 min 49 s, 692 s of searches and 310 s of one-time calibrations, the searches times 10; "
        "earlier code measured in parts: about three hours; at least 21 minutes at this design's floor, "
        "bench_audit_floor.py; docs/audit.md); --quick: 53 s with the tables and calibration kept, about 4 minutes on "
        "an empty cache (227-250 s, docs/results.md)"
    )

    def _prompts(self, ctx: Context, model: LoadedModel) -> list[list[int]]:
        s = ctx.size

        def build() -> list[list[int]]:
            if s.get("prompts_file"):
                return read_prompts(model, s["prompts_file"], s.get("length"))
            per_kind = max(1, math.ceil(s["prompts"] / len(s["kinds"])))
            found = evaluation_prompts(model, per_kind, s["length"], ctx.seed, kinds=s["kinds"])
            return [list(p.ids) for p in found][: s["prompts"]]

        return ctx.once(("prompts", model.name), build)

    def _tables(self, ctx: Context, model: LoadedModel) -> None:
        """Every first-position table the units of ``model`` read, those not kept built in one pass of the
        vocabulary, and the rows searches' calibration forwards at every layer they read, in the forwards of the
        highest (:func:`lminvert.invert.rows.calibration.calibrate_rows`; a ``last`` leak's search has its own)."""
        leaks = [
            make_leak(leak, model, layer)
            for leak in ctx.size["leaks"]
            for layer in model.probe.layers(ctx.size["layers"])
        ]
        first_position_tables(model, [leak.states_layer for leak in leaks])
        calibrate_rows(model, [leak.states_layer for leak in leaks if leak.name != "last"])

    def units(self, ctx: Context) -> list[Unit]:
        units = []
        defences = [parse_defence(d) for d in ctx.size["defences"]]
        for name in ctx.models:
            model = ctx.load(name)
            for leak in ctx.size["leaks"]:
                for layer in model.probe.layers(ctx.size["layers"]):
                    made = make_leak(leak, model, layer)  # one-line errors before any long work
                    for defence in defences:
                        defence.check(made.width)
                        key = _key(f"{name}.{leak}.L{layer}.{defence.label}")
                        params = {"model": name, "leak": leak, "layer": str(layer), "defence": defence.label}
                        units.append(Unit(key, f"{leak} L{layer} {defence.label}", params))
        return units

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        p = unit.params
        model = ctx.load(p["model"])
        layer = model.probe.layer(p["layer"] if p["layer"] == "final" else int(p["layer"]))
        prompts = self._prompts(ctx, model)
        ctx.once(("tables", p["model"]), lambda: self._tables(ctx, model))
        leak = make_leak(p["leak"], model, layer)
        last = LastOptions(seconds=float(ctx.size["last_seconds"]))
        attack = ctx.once(("attack", p["model"], p["leak"], str(layer)), lambda: Attack(leak, last=last))
        for other in ctx.memo.values():  # the states kept for another leak or layer serve no later unit
            if isinstance(other, Attack) and other is not attack and other.memo is not None:
                other.memo.clear()
        clean = ctx.once(("rows", p["model"], p["leak"], str(layer)), lambda: [leak.capture(ids) for ids in prompts])
        before = ctx.once(
            ("outputs", p["model"], p["leak"], str(layer)), lambda: [outputs(leak, x, None) for x in prompts]
        )
        defence = parse_defence(p["defence"])
        generator = torch.Generator().manual_seed(ctx.seed * 7919 + sum(map(ord, unit.key)))
        shipped = [defence.apply(rows, generator) for rows in clean]
        states = None
        if p["leak"] == "states":
            states = ctx.once(("encode", p["model"], str(layer)), lambda: encode(model, prompts, layer))
        found = attack.run(shipped, states)
        rows = []
        for i, (ids, rows_i, s, f, out) in enumerate(zip(prompts, clean, shipped, found, before, strict=True)):
            row = {"model": p["model"], "leak": p["leak"], "layer": str(layer), "defence": p["defence"], "prompt": i}
            row |= _row(ids, f)
            row["perturbation"] = perturbation(rows_i, s)
            row |= utility(leak, ids, out, rows_i, s.kept)
            rows.append(row)
        return rows

    def summarise(self, ctx: Context, rows: Sequence[Row]):
        return summarise(ctx, rows)
