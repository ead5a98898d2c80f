"""`lminvert lab break`: the constructions under which injectivity fails, and what inversion does on them.

Each unit builds one model (see :mod:`.constructions`), sends one prompt set through it and searches the
last-token states of every pair (:func:`lminvert.pairwise_min`, exact) at the first and the last block. The prompt
set mixes corpus windows with the variants a construction could confuse: the same window with another first
token, with its first two tokens swapped, and with each member of a tied-token group at one position. Pairs under
1e-6 are split into *tied inputs* (the same input vectors: the paper's tied-parameter exception) and *distinct
inputs*. Then prompts of the closest pair are encoded at the last block and inverted; a position whose answer is
wrong must be flagged (``uncertain_positions``): a wrong answer left unflagged is counted, never hidden.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..collisions import pairwise_min
from ..errors import LminvertError
from ..experiments.base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group
from ..forward import encode, last_token_states, prompt_states
from ..invert import invert
from ..invert.results import InversionResult
from ..models import LoadedModel
from ..models.ties import representatives, same_input, tied_token_groups
from ..report.text import fmt
from . import constructions as C
from .common import THRESHOLD, corpus_ids, random_model, tokenizer

log = logging.getLogger(__name__)

# name -> (architecture, edit or activation bits, analytic?, what it is)
CONSTRUCTIONS: dict[str, tuple[str, Callable | int | None, bool, str]] = {
    "tied-rows": ("llama", None, True, "two tokens with bit-identical embedding rows"),
    "hard-step": ("llama", C.hard_step, False, "every block output replaced by its Heaviside step"),
    "act-2bit": ("llama", 2, False, "block outputs quantised to 2 bits (3 levels, static range)"),
    "act-4bit": ("llama", 4, False, "block outputs quantised to 4 bits (static range)"),
    "act-8bit": ("llama", 8, False, "block outputs quantised to 8 bits (static range)"),
    "llama-analytic": ("llama", None, True, "contrast: the same Llama, full precision, unmodified"),
    "no-positions": ("gpt2", C.indistinct_positions, True, "GPT-2, position table and attention outputs zeroed"),
    "gpt2-analytic": ("gpt2", None, True, "contrast: the same GPT-2, unmodified"),
}
HOOKED = {"hard-step", "act-2bit", "act-4bit", "act-8bit"}  # forward hooks, weights unchanged
FLOOR = 1e-12  # zero distances drawn at this value on log axes


class Break(Experiment):
    name = "break"
    title = "Where injectivity breaks: tied rows, discretised activations, indistinguishable positions"
    paper = (
        "The guarantee needs analytic components and generic parameters: non-analytic pieces, quantised "
        "activations or deliberately tied parameters (identical embedding rows, indistinguishable positions) can "
        "create collisions. A study of quantised activations (arXiv 2511.14808) reports collisions under 4-bit "
        "activation quantisation of Llama-3 and Qwen, none in full precision or with 8-bit activations."
    )
    models = ()
    quick_size = {
        "constructions": list(CONSTRUCTIONS),
        "tied_model": "planted",
        "hidden": 64,
        "layers": 2,
        "base_prompts": 150,
        "tokens": 10,
        "first_token_bases": 20,
        "first_token_variants": 4,
        "tied_bases": 8,
        "invert_prompts": 1,  # certifying a hooked construction costs |V| verifications per position
        "bruteforce": [],
    }
    full_size = {
        "constructions": list(CONSTRUCTIONS),
        "tied_model": "smollm2-135m",
        "hidden": 128,
        "layers": 4,
        "base_prompts": 400,
        "tokens": 12,
        "first_token_bases": 100,
        "first_token_variants": 5,
        "tied_bases": 20,
        "invert_prompts": 2,
        "bruteforce": ["act-2bit"],
    }
    full_duration = "about 8 minutes (7 constructions; SmolLM2 for the tied rows)"

    def units(self, ctx: Context) -> list[Unit]:
        unknown = set(ctx.size["constructions"]) - set(CONSTRUCTIONS)
        if unknown:
            raise LminvertError(f"unknown constructions {sorted(unknown)}: use {', '.join(CONSTRUCTIONS)}")
        return [Unit(name, CONSTRUCTIONS[name][3], {"construction": name}) for name in ctx.size["constructions"]]

    # ------------------------------------------------------------------ models and prompts
    def _model(self, ctx: Context, name: str) -> LoadedModel:
        s = ctx.size
        arch, edit, _, _ = CONSTRUCTIONS[name]
        if name == "tied-rows" and s["tied_model"] != "planted":
            return ctx.load(s["tied_model"])
        net = random_model(arch, ctx.seed, len(tokenizer(ctx)), s["hidden"], s["layers"])
        if name == "tied-rows":  # plant one tie: a token of the corpus prompts gets a rare token's twin row
            source = corpus_ids(ctx, s["base_prompts"], s["tokens"], ctx.seed)[0][s["tokens"] // 2]
            C.tie_rows(net, source, (source + len(tokenizer(ctx)) // 2) % len(tokenizer(ctx)))
        elif isinstance(edit, int):  # static ranges: the largest |activation| of each block on the corpus prompts
            calibration = corpus_ids(ctx, s["base_prompts"], s["tokens"], ctx.seed)[:64]
            plain = LoadedModel.wrap("calibration", net)
            layers = range(1, s["layers"] + 1)
            states = prompt_states(plain, calibration, list(layers), progress=False)
            clips = [max(float(p[layer].abs().max()) for p in states) for layer in plain.probe.layers(list(layers))]
            C.quantise_activations(net, edit, clips)
        elif edit is not None:
            edit(net)
        return LoadedModel.wrap(f"{name}@{ctx.seed}", net, tokenizer(ctx))

    def _prompts(
        self, ctx: Context, groups: Sequence[Sequence[int]], tied_only: bool = False
    ) -> tuple[list[list[int]], list[str]]:
        """The prompt set and each prompt's family: corpus, first-token, swap, tied (``tied_only``: corpus
        windows and the tied family, for a real model whose forward is expensive)."""
        s = ctx.size
        base = corpus_ids(ctx, s["base_prompts"], s["tokens"], ctx.seed)
        rng = np.random.default_rng(ctx.seed)
        prompts, families, seen = [], [], set()

        def add(ids: list[int], family: str) -> None:
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                prompts.append(ids)
                families.append(family)

        if groups and tied_only:  # a real model with tied rows: corpus windows and the tied family only
            base = base[: 5 * s["tied_bases"]]
        for ids in base:
            add(list(ids), "corpus")
        firsts = sorted({ids[1] for ids in base})  # second tokens of the windows: ordinary text tokens
        for ids in [] if tied_only else base[: s["first_token_bases"]]:
            for v in rng.choice(firsts, size=min(len(firsts), s["first_token_variants"]), replace=False):
                add([int(v), *ids[1:]], "first-token")
        for ids in [] if tied_only else base:
            add([ids[1], ids[0], *ids[2:]], "swap")
        middle = s["tokens"] // 2
        for ids in base[: s["tied_bases"]]:
            for g in groups[:4]:
                for token in g:
                    add([*ids[:middle], token, *ids[middle + 1 :]], "tied")
        return prompts, families

    # ------------------------------------------------------------------ the unit
    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        name = unit.params["construction"]
        _, _, analytic, what = CONSTRUCTIONS[name]
        model = self._model(ctx, name)
        groups = tied_token_groups(model)
        rep = representatives(groups)
        real = name == "tied-rows" and ctx.size["tied_model"] != "planted"
        prompts, families = self._prompts(ctx, groups, tied_only=real)
        top = model.probe.n_layers
        common = {"construction": name, "analytic": analytic, "what": what, "model": model.name}
        common |= {"architecture": model.model.config.model_type, "n_layers": top, "tied_groups": groups}
        rows: list[Row] = []
        pick: list[list[int]] = []
        for layer, x in last_token_states(model, prompts, [1, top]).items():
            result = pairwise_min(np.ascontiguousarray(x), k=3, threshold=THRESHOLD)
            below = result.below_threshold
            tied = [p for p in below if same_input(prompts[p.i], prompts[p.j], rep)]
            distinct = [p for p in below if not same_input(prompts[p.i], prompts[p.j], rep)]
            kinds = sorted({f"{families[p.i]}/{families[p.j]}" for p in distinct})
            example = (distinct or tied or list(result.closest))[:1]
            rows.append(
                {
                    **common,
                    "test": "search",
                    "layer": int(layer),
                    "prompts": len(prompts),
                    "pairs": len(prompts) * (len(prompts) - 1) // 2,
                    "min_distance": float(result.min_distance),
                    "below_threshold": int(result.n_below_threshold),
                    "below_tied_inputs": len(tied),
                    "below_distinct_inputs": len(distinct),
                    "distinct_families": kinds,
                    "example": [[prompts[p.i], prompts[p.j], p.distance] for p in example],
                }
            )
            if int(layer) == top:
                pick = [prompts[example[0].i], prompts[example[0].j]] if example else []
        pick = (pick or [prompts[0], prompts[1]])[: ctx.size["invert_prompts"]]
        brute = 1 if name in ctx.size["bruteforce"] else 0  # the oracle: every token at every position
        at = 1 if real else top  # a real model's ties show at any layer; block 1 keeps every sweep cheap
        for method, chosen in (("sipit", pick), ("bruteforce", pick[:brute])):
            if not chosen:
                continue
            start = time.perf_counter()
            states = encode(model, chosen, at)
            # hooked models share their weights hash with the plain model: keep them off the cached tables
            results = invert(model, states, method=method, first_table=name not in HOOKED)
            seconds = (time.perf_counter() - start) / len(chosen)
            rows += [
                _invert_row(common, method, at, truth, r, rep, seconds)
                for truth, r in zip(chosen, results, strict=True)
            ]
        return rows

    # ------------------------------------------------------------------ summary
    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        search = [r for r in rows if r["test"] == "search"]
        inverts = [r for r in rows if r["test"] == "invert"]
        by_construction = group(search, "construction")
        tables = [_search_table(by_construction), _invert_table(inverts)]
        tied = [r for r in search if r["construction"] == "tied-rows"][:1]
        if tied:
            tables.append(_tied_table(ctx, tied[0]))
        figures = [_min_distance_figure(by_construction), _collisions_figure(by_construction)]
        wrong = sum(len(r["wrong_unflagged"]) for r in inverts)
        notes = [f"Wrong positions returned without a flag, over every construction and method: {wrong}."]
        return Summary(tables, figures, notes)


def _search_table(by_construction: dict[tuple, list[Row]]) -> Table:
    """One row per construction: its first-block and last-block search rows side by side."""
    search_rows = []
    for (name,), rs in by_construction.items():
        first, last = rs[0], rs[-1]
        ex = last["example"][0] if last["example"] else None
        search_rows.append(
            [
                name,
                first["what"],
                first["model"],
                first["prompts"],
                fmt(first["min_distance"]),
                fmt(last["min_distance"]),
                f"{_count(first, 'below_distinct_inputs')} / {_count(last, 'below_distinct_inputs')}",
                f"{_count(first, 'below_tied_inputs')} / {_count(last, 'below_tied_inputs')}",
                ", ".join(sorted({*first["distinct_families"], *last["distinct_families"]})) or "-",
                "-" if ex is None else f"{ex[0]} vs {ex[1]} ({fmt(ex[2])})",
            ]
        )
    return Table(
        "Collision search on each construction (last-token states, exact pairwise minimum)",
        [
            "construction",
            "what",
            "model",
            "prompts",
            "min distance, block 1",
            "min distance, last block",
            "pairs < 1e-6, distinct inputs (block 1 / last)",
            "pairs < 1e-6, tied inputs (block 1 / last)",
            "families colliding",
            "closest pair (ids)",
        ],
        search_rows,
        note=(
            "Prompts: corpus windows plus variants (another first token; first two tokens swapped; each "
            "member of a tied group at the middle position). 'Tied inputs': the two prompts feed identical "
            "input vectors (tied embedding rows); 'distinct inputs': a real failure of injectivity."
        ),
    )


def _invert_table(inverts: list[Row]) -> Table:
    """One row per (construction, method): exact prompts, wrong and flagged positions, time."""
    invert_rows = []
    for (name, method), rs in group(inverts, "construction", "method").items():
        invert_rows.append(
            [
                name,
                method,
                len(rs),
                sum(r["exact"] for r in rs),
                sum(len(r["wrong"]) for r in rs),
                sum(len(r["flagged"]) for r in rs),
                sum(len(r["tied_flagged"]) for r in rs),
                sum(len(r["wrong_unflagged"]) for r in rs),
                fmt(sum(r["seconds"] for r in rs) / len(rs)),
            ]
        )
    return Table(
        "What inversion does on them (all positions' states at the last block; block 1 for a real model)",
        [
            "construction",
            "method",
            "prompts",
            "exact",
            "wrong positions",
            "flagged positions",
            "flagged as tied",
            "wrong and NOT flagged",
            "seconds per prompt",
        ],
        invert_rows,
        note=(
            "sipit: the default method, stops at the first candidate inside the acceptance ball on an "
            "injective model; on the hooked constructions (hard-step, act-*), whose injectivity cannot be "
            "assumed, it certifies every position against the whole vocabulary by itself (brute force's "
            "cost); bruteforce: verifies the whole vocabulary at every position. A position is flagged "
            "(uncertain) when no candidate passed, another candidate was also inside the ball and not "
            "decisively farther under the plain forward, or its token has tied twins."
        ),
    )


def _tied_table(ctx: Context, tied: Row) -> Table:
    """The tied embedding rows of the ``tied-rows`` construction's model (its first search row)."""
    return Table(
        f"Tied embedding rows of {tied['model']}",
        ["group", "token ids", "tokens"],
        [[i + 1, g, " ".join(repr(tokenizer_text(ctx, t)) for t in g)] for i, g in enumerate(tied["tied_groups"])],
    )


def _min_distance_figure(by_construction: dict[tuple, list[Row]]) -> FigureSpec:
    """Bars: each construction's minimum distance at block 1 and the last block (zero drawn at ``FLOOR``)."""
    names = [name for (name,) in by_construction]
    bars = [(max(rs[0]["min_distance"], FLOOR), max(rs[-1]["min_distance"], FLOOR)) for rs in by_construction.values()]
    return FigureSpec(
        "break_min_distance",
        f"Minimum pairwise distance at block 1 and the last block per construction (zero drawn at "
        f"{FLOOR:g}): the constructions fall to the floor, their analytic contrasts stay far above the "
        "threshold.",
        kind="bar",
        title="Constructed collisions",
        ylabel="minimum L2 distance",
        series=[Series(label, names, [b[i] for b in bars]) for i, label in enumerate(("block 1", "last block"))],
        logy=True,
        hline=THRESHOLD,
        hline_label="collision threshold 1e-6",
    )


def _collisions_figure(by_construction: dict[tuple, list[Row]]) -> FigureSpec:
    """Bars: each construction's pairs under the threshold at block 1 and the last block."""
    names = [name for (name,) in by_construction]
    bars = [(rs[0]["below_threshold"], rs[-1]["below_threshold"]) for rs in by_construction.values()]
    return FigureSpec(
        "break_collisions",
        "Pairs under the 1e-6 threshold at block 1 and at the last block, per construction.",
        kind="bar",
        title="Colliding pairs",
        ylabel="pairs < 1e-6",
        series=[Series(label, names, [b[i] for b in bars]) for i, label in enumerate(("block 1", "last block"))],
    )


def _count(row: Row, key: str) -> str:
    """A classified count; the search lists the first 10,000 pairs under the threshold (it counts them all)."""
    listed = row["below_tied_inputs"] + row["below_distinct_inputs"]
    if listed >= row["below_threshold"]:
        return f"{row[key]:,}"
    return f"{row[key]:,} of {listed:,} listed ({row['below_threshold']:,} in all)"


def tokenizer_text(ctx: Context, token: int) -> str:
    return tokenizer(ctx).decode([token])


def _invert_row(
    common: Row, method: str, at: int, truth: list[int], result: InversionResult, rep: dict[int, int], seconds: float
) -> Row:
    """One inverted prompt's row: what was recovered, flagged, wrong, and whether wrong tokens were flagged."""
    got = list(result.token_ids)
    flagged = set(result.uncertain_positions)
    wrong = [t for t, (a, b) in enumerate(zip(got, truth, strict=True)) if a != b]
    return {
        **common,
        "test": "invert",
        "method": method,
        "layer": at,
        "truth": truth,
        "recovered": got,
        "exact": got == truth,
        "whole_vocabulary": result.whole_vocabulary,
        "flagged": sorted(flagged),
        "tied_flagged": [t for t, p in enumerate(result.positions) if p.tied_with],
        "wrong": wrong,
        "wrong_unflagged": [t for t in wrong if t not in flagged],
        "same_input": same_input(got, truth, rep),
        "seconds": seconds,
    }
