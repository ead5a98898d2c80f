"""`lminvert invert`: recover the exact prompt(s) from a hidden-states file or a saved KV cache."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ..captures import LIBRARIES, library_layer
from ..errors import LminvertError
from ..invert import METHODS, POLICIES, Leak, Run, Search, grouped, invert
from ..invert.last import ROUTE as LAST_ROUTE
from ..invert.rows.route import POLICY as ROWS_POLICY
from ..invert.views import VIEWS
from ..kv_captures import is_kv_file, read_kv
from ..paths import atomic_file, check_output_file
from ..runs import run_metadata
from ..states import HiddenStates
from .common import (
    add_command,
    add_ray_arg,
    add_states_args,
    executor_from_args,
    model_for_kv,
    model_for_states,
    print_json,
)
from .recast import cast_first, cast_hint, reread

EXAMPLES = """examples:
  lminvert encode --layer 15 --text "my PIN is 4921" --out leak.safetensors
  lminvert invert leak.safetensors                       # model and layer from the file
  lminvert invert leak.safetensors --json --out result.json
  lminvert invert leak.npy --model smollm2-135m          # a capture from elsewhere: layer found, --source float
  lminvert invert leak.pt --model smollm2-135m --layer 15 --dtype bfloat16 --source noise:0.01
  lminvert invert cache.pt --model smollm2-135m --leak kv --layer 15   # transformers' past_key_values, block 15
  lminvert invert cache.pt --model smollm2-135m --leak kv --layer 14 --source-library hf   # cache.layers[14]
  lminvert invert vector.npy --model smollm2-135m --leak last --layer 15 --normalised  # one pooled vector
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "invert", "hidden-states file -> exact prompt", __doc__, EXAMPLES)
    add_states_args(
        parser,
        model_help="model (default: the one recorded in the file)",
        dtype_help="precision (default: the one recorded in the file, else float32); must match the file's",
    )
    _add_leak_args(parser.add_argument_group("the leak (invert(..., leak=Leak(...)))"))
    _add_search_args(parser.add_argument_group("the search (invert(..., search=Search(...)))"))
    runs = parser.add_argument_group("where it runs (invert(..., run=Run(...)))")
    runs.add_argument(
        "--together",
        type=int,
        default=32,
        help=(
            "prompts inverted at once: their candidates share one forward per step (1: one at a time, as KV caches, "
            "one vector and defended states always go)"
        ),
    )
    add_ray_arg(runs)
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per prompt")
    parser.add_argument("--out", default=None, help="also write the JSON results to this file")
    parser.set_defaults(func=run)


def _add_leak_args(group: argparse._ArgumentGroup) -> None:
    """What the file holds (:class:`lminvert.invert.Leak`): the layer (a KV cache's block) and whose numbering it is,
    the kind of leak, the states' error model, noise added here, and whether the layer is checked against the
    states."""
    group.add_argument(
        "--layer",
        default=None,
        help="layer (default: the one recorded in the file, else found from the states); lminvert's numbering: "
        "see --source-library",
    )
    group.add_argument(
        "--leak",
        default=None,
        choices=list(VIEWS),
        help="what the file holds: states (every position's state at --layer), kv (a block's KV cache as "
        "transformers saves it: --layer is the block, 1..L, transformers' cache.layers[B-1]), last (one vector per "
        "prompt, its last position's state: a [d] or [N, d] array, or each prompt's last row of a states file; whole "
        "prompts up to --max-length tokens are tried); default: kv for a file that holds keys and values, else states",
    )
    group.add_argument(
        "--source-library",
        default="lminvert",
        choices=LIBRARIES,
        help="whose numbering --layer uses: hf (output_hidden_states index; the last is after the final norm), "
        "nnsight (model.model.layers[i]), tl (blocks.i.hook_resid_post), vllm (eagle_aux_hidden_state_layer_ids), "
        "lminvert (block outputs 0..L, final)",
    )
    group.add_argument(
        "--source",
        default=None,
        help="where the states come from, as an error model: exact (lminvert encode), float (computed elsewhere in "
        "the same dtype: padded batches, other kernels or libraries), noise:SIGMA, quant:int8|int4|bf16|fp16|fp8 "
        "(quant:bf16 / quant:fp16 with --dtype float32: a float32 model's rows saved in bfloat16 / float16) "
        "(default: exact for a states file from encode, float for a bare array)",
    )
    group.add_argument("--noise", type=float, default=0.0, help="add relative Gaussian noise of this level")
    group.add_argument(
        "--normalised",
        action="store_true",
        help="--leak last: the vector was scaled to unit length, as embedding APIs return it (directions compared)",
    )
    group.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score a bare array against every layer first and refuse a --layer it decisively does not match, or "
        "states that fit no layer of the model (--no-check: search the given layer anyway)",
    )


def _add_search_args(group: argparse._ArgumentGroup) -> None:
    """How to search (:class:`lminvert.invert.Search`): options that change how far the search goes, never what it
    accepts."""
    group.add_argument(
        "--method",
        default="sipit",
        choices=METHODS,
        help="sipit: policy-guided; bruteforce: verify the whole vocabulary (slow oracle)",
    )
    group.add_argument("--policy", default="linear", choices=list(POLICIES), help="candidate order for sipit")
    group.add_argument("--max-candidates", type=int, default=None, help="budget per position (default |V|)")
    group.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="bound the search: after this many seconds each position stops after its first batch and keeps the "
        "closest candidate verified, with the acceptor's verdict on that evidence, and (KV caches, defended states) "
        "nothing is chosen by the next row; a first run's one-time builds (announced) are not counted (default: no "
        "bound; --leak last: each vector's, default 60)",
    )
    group.add_argument(
        "--tolerance-scale",
        type=float,
        default=1.0,
        help="multiply the measured acceptance radii (e.g. 4 for states computed on other hardware)",
    )
    group.add_argument(
        "--certify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every position against the whole vocabulary, so a colliding token is flagged (brute force's "
        "cost; default: only for a model whose computation is edited by forward hooks, where injectivity cannot "
        "be assumed)",
    )
    _add_speed_args(group)
    group.add_argument("--seed", type=int, default=0, help="seed of the random candidate orders and of --noise")
    group.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="--leak last: the longest prompt tried, in tokens (default 8; --max-seconds bounds each vector, default "
        "60)",
    )


def _add_speed_args(group: argparse._ArgumentGroup) -> None:
    """The options that change how fast the search goes, never its answer."""
    group.add_argument(
        "--screen",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a float32 model's large candidate batches first with bfloat16 GEMMs and verify in float32 only the "
        "candidates near the observed state (speed only, never the answer; default: on a CPU with native bfloat16 "
        "GEMMs)",
    )
    group.add_argument(
        "--speculate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verify the next positions' first guesses in the same forward as a position's candidates (speed only)",
    )
    group.add_argument(
        "--scout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="guess the whole prompt first by a search whose forwards run with bfloat16 GEMMs, then check the guess "
        "with one plain forward (speed only, never the answer; default: a float32 model on a CPU with native bfloat16 "
        "GEMMs, from 30%% of the depth on, where such a state lies within 2%% of its norm, without --max-candidates)",
    )


def options_from_args(args: argparse.Namespace, kind: str) -> tuple[Leak, Search, Run]:
    """The three option groups of :func:`lminvert.invert` as the command's options give them, checked (one-line
    errors before anything is loaded)."""
    return grouped(
        Leak(kind=kind, source=args.source, noise=args.noise, check=args.check, normalised=args.normalised),
        Search(
            method=args.method, policy=args.policy, max_candidates=args.max_candidates, max_seconds=args.max_seconds,
            tolerance_scale=args.tolerance_scale, certify=args.certify, screen=args.screen, speculate=args.speculate,
            scout=args.scout, seed=args.seed, max_length=args.max_length,
        ),
        Run(together=args.together, executor=executor_from_args(args), progress=not args.json),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    leak, search, runs = options_from_args(args, args.leak or ("kv" if is_kv_file(args.states) else "states"))
    if args.out:
        check_output_file(args.out)
    model, name, states, layer = _read(args, leak.kind)
    model, leak, layer, cast = cast_first(args, model, name, states, layer, leak)
    results = invert(model, states, layer, leak=leak, search=search, run=runs)
    if cast is not None:
        results = [replace(r, notes=(*r.notes, cast)) for r in results]
    model, results = reread(args, model, name, states, leak, search, runs, results)
    # per-token text and tolerances make the JSON self-describing for `lminvert report`; the run's versions, machine
    # (CPU features, threads) and the model's numeric path, so the result can be reproduced
    run = run_metadata(model.describe(), args.seed)
    docs = [
        {
            **r.to_json(),
            "tokens": [model.decode([t]) for t in r.token_ids],
            "tolerances": [p.tolerance for p in r.positions],
            "run": run,
        }
        for r in results
    ]
    if args.out:
        with atomic_file(args.out) as tmp:
            tmp.write_text(json.dumps(docs, indent=2))
    if args.json:
        print_json(docs)
        return 0
    _summary(results)
    _reader_hint(model, name, results[0], leak.kind)
    cast_hint(model, states.dtype, results, leak.kind)
    return 0


def _read(args: argparse.Namespace, leak: str):
    """The model, its name, what the file holds (states or a KV cache) and the layer asked for (None: the file's)."""
    if leak == "kv":
        block = None if args.layer is None else kv_block_number(args.layer, args.source_library)
        states = read_kv(args.states, block=block, key=args.key, mask=args.mask)
        if not args.model:
            raise LminvertError(f"{Path(args.states).name} is a KV cache, which records no model: pass --model")
        name, layer = args.model, block  # the block asked for: a file of one block's tensors does not say its own
        model, states = model_for_kv(args, states)
    else:
        states = HiddenStates.load(args.states, key=args.key, mask=args.mask)
        name = args.model or states.model
        if not name:
            raise LminvertError(f"{Path(args.states).name} does not record its model: pass --model (and --layer)")
        model, states = model_for_states(args, name, states)
        layer = None if args.layer is None else library_layer(args.layer, args.source_library, model.probe.n_layers)
    return model, name, states, layer


def _summary(results) -> None:
    """Each prompt's text, cost and verdicts, as the user reads them."""
    for i, r in enumerate(results):
        flag = f"  uncertain positions: {r.uncertain_positions}" if r.uncertain_positions else ""
        counts = ", ".join(f"{n} {v}" for v, n in r.verdict_counts.items() if n)
        print(f"[{i}] {r.text!r}")
        if r.policy == LAST_ROUTE:  # one vector: whole prompts were verified, not candidates per position
            print(f"    {len(r.token_ids)} tokens in {r.seconds:.2f} s ({r.dtype} on {r.device})")
        else:
            print(
                f"    {len(r.token_ids)} tokens in {r.seconds:.2f} s, {sum(r.candidates_checked)} candidates verified "
                f"({100 * r.explored_fraction:.3f}% of the vocabulary per position; {r.dtype} on {r.device})"
                f"{'; certified against the whole vocabulary' if r.whole_vocabulary else ''}"
            )
        print(f"    verdicts ({r.source} source): {counts}{flag}")
        for note in r.notes:
            print(f"    note: {note}")


def _reader_hint(model, name: str, result, leak: str = "states") -> None:
    """Where the search that ran reads states with the linear map (no network cached), say how a reading network is
    trained (it is never trained implicitly: minutes of a CPU): the engine's policy where it reads, and the rows
    search of a states leak (defended states: it reads them too). Layer and policy are the ones the search used."""
    if result.policy == ROWS_POLICY:
        if leak != "states":  # a KV cache's rows are read back through a map of their own, or ranked by the table
            return
    else:
        policy = POLICIES.get(result.policy)
        if policy is None or not policy().uses_reading:  # brute force, --certify (a sweep), or a policy reading nothing
            return
    from ..invert.reader import lent_from, load_reader

    layer = model.probe.layer(result.layer)
    if load_reader(model, layer) is None:
        prepare = (  # not prepared yet: the preparation's quick network may serve this layer
            f"`lminvert models --prepare {name}` makes a quick one once and lends it to the layers it reads better "
            "than their maps (about 4 minutes for SmolLM2 on a 2-core CPU); "
            if lent_from(model, layer) is None
            else ""
        )
        print(
            f"hint: no reading network is cached for layer {layer.name} of this model; {prepare}`lminvert models "
            f"--prepare {name} --reader {layer.name}` trains one for this layer in minutes, for every dtype, and makes "
            "inversion at this layer faster",
            file=sys.stderr,
        )


def kv_block_number(index: str, library: str) -> int:
    """lminvert's block number (1..L) of a KV cache index as ``library`` numbers it: lminvert's own, or transformers'
    ``cache.layers[i]`` (``hf``: block ``i + 1``)."""
    if library not in ("lminvert", "hf"):
        raise LminvertError(f"--leak kv numbers blocks as lminvert (1..L) or hf (cache.layers[i]), not {library}")
    try:
        i = int(index)
    except ValueError:
        raise LminvertError(f"--layer {index} for a KV cache: give the block's integer number") from None
    return i + 1 if library == "hf" else i
