"""`lminvert demo`: the main job on the default model, end to end, offline."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..encode import encode
from ..models import DEFAULT_MODEL, load_model
from ..states import HiddenStates

SAMPLE = "Hi, I'm Alice Smith and my card number is 4111 1111 1111 1111."


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="run the end-to-end demo on the default model",
        description="Encode a sample prompt, show what a leaked states file holds.",
    )
    parser.add_argument("--out", default="out/demo", help="directory for the demo's files")
    parser.add_argument("--layer", default="15", help="layer to encode at")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = load_model(DEFAULT_MODEL)
    info = model.describe()
    print(
        f"model    {model.name}: {info['architecture']}, {info['n_layers']} layers, d={info['hidden_size']}, "
        f"|V|={info['vocab_size']}, weights {info['weights_hash']} (loaded in {time.perf_counter() - start:.1f} s)"
    )
    states = encode(model, [SAMPLE], args.layer)
    path = states.save(out / "leak.safetensors")
    loaded = HiddenStates.load(path)
    print(f"prompt   {SAMPLE!r}")
    print(
        f"encoded  layer {loaded.layer}: {loaded.lengths[0]} positions x {loaded.hidden_size} floats -> {path} "
        f"({path.stat().st_size / 1024:.0f} KiB, no token ids stored)"
    )
    norms = [f"{float(x):.0f}" for x in loaded.states[0].norm(dim=-1)[:6]]
    print(f"norms    first positions' state norms: {', '.join(norms)} ...")
    return 0
