"""`lminvert models`: list registered aliases and whether they are usable offline now."""

from __future__ import annotations

import argparse
import functools

from ..errors import LminvertError
from ..invert import reader
from ..invert.tables import table_path
from ..models import REGISTRY, Layer, LoadedModel, load_model, sources
from ..models.loading import DTYPES
from .common import add_command, print_json

EXAMPLES = """examples:
  lminvert models                                         # the aliases, their shapes, whether usable offline
  lminvert models --prepare smollm2-135m                  # convert the GGUF into the cache now
  lminvert models --prepare smollm2-135m --reader 15,30   # also train reading networks for layers 15 and 30
  lminvert models --prepare smollm2-135m --tables 1,15    # first-position tables of layers 1 and 15, one pass
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "models", "list model aliases", "List registered model aliases.", EXAMPLES, defaults=False
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--prepare", metavar="ALIAS", help="convert ALIAS into the cache now (idempotent)")
    parser.add_argument(
        "--signature",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --prepare: also cache the model's layer signature, so that a capture's layer is found in seconds "
        "on first use",
    )
    parser.add_argument(
        "--inversion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --prepare: also make what inversion builds on first use: the reading map at every layer, a quick "
        "reading network at the last layer, lent to the layers below it that it reads better than their maps, and "
        "the last layer's tables (about 4 minutes once on a 2-core CPU; lminvert.invert.preparation)",
    )
    parser.add_argument(
        "--tables",
        metavar="LAYERS",
        help="with --prepare: also build the first-position tables of LAYERS (e.g. 1,15) not kept yet, in one pass of "
        "the vocabulary up to the highest (a table built on first use costs a pass of its own)",
    )
    _add_reader_args(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="with --prepare: the dtype of the layer signature, tables and reading networks",
    )
    parser.add_argument("--device", default="auto", help="with --prepare: where the model runs")
    parser.set_defaults(func=run)


def _add_reader_args(parser: argparse.ArgumentParser) -> None:
    """``--reader LAYERS`` and the options of its training."""
    parser.add_argument(
        "--reader",
        metavar="LAYERS",
        help="with --prepare: also train and cache the reading network at LAYERS (e.g. 30, or 15,30), which "
        "inversion at those layers then uses to propose candidates (minutes per layer on a CPU)",
    )
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="with --reader: train again at layers that already have a reading network cached (skipped otherwise)",
    )
    parser.add_argument(
        "--negatives",
        type=int,
        default=None,
        metavar="N",
        help=f"with --reader: vocabulary rows drawn into each training step's softmax (default {reader.NEGATIVES}, a "
        "few times faster; 0: the whole vocabulary, which read SmolLM2's last layer better)",
    )
    parser.add_argument(
        "--random-prompts",
        type=int,
        default=None,
        metavar="N",
        help=f"with --reader: random-id training prompts beside the {reader.TEXT_PROMPTS} text windows (default "
        f"{reader.RANDOM_PROMPTS}; 4000 read SmolLM2's last layer's random ids far better, at 3x the training time)",
    )
    parser.add_argument(
        "--products",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="with --reader: the precision of training's products, and of the training prompts' forward for a float32 "
        "model (default auto: bfloat16 on a GPU and on a CPU with native bfloat16 GEMMs, 2-2.7x faster there and the "
        "same held-out ranks; float32 elsewhere)",
    )


def run(args: argparse.Namespace) -> int:
    if args.reader and not args.prepare:
        raise LminvertError("--reader needs --prepare ALIAS (the model to train the reading network for)")
    if args.tables and not args.prepare:
        raise LminvertError("--tables needs --prepare ALIAS (the model to build the first-position tables of)")
    if args.negatives is not None and (not args.reader or args.negatives < 0):
        raise LminvertError("--negatives needs --reader LAYERS and a count of at least 0 (0: the whole vocabulary)")
    if args.random_prompts is not None and (not args.reader or args.random_prompts < 0):
        raise LminvertError("--random-prompts needs --reader LAYERS and a count of at least 0")
    if args.products is not None and not args.reader:
        raise LminvertError("--products needs --reader LAYERS (the layers whose training it sets)")
    if args.retrain and not args.reader:
        raise LminvertError("--retrain needs --reader LAYERS (the layers to train the reading network at again)")
    if args.prepare:
        _prepare(args)
        return 0
    rows = []
    for spec in REGISTRY.values():
        rows.append(
            {
                "alias": spec.alias,
                "architecture": spec.architecture,
                "layers": spec.n_layers,
                "hidden_size": spec.hidden_size,
                "vocab_size": spec.vocab_size,
                "source": spec.source,
                "available_offline": sources.is_available(spec),
                "converted": sources.is_converted(spec.alias) if spec.kind == "gguf-package" else None,
            }
        )
    if args.json:
        print_json(rows)
        return 0
    header = f"{'alias':<18} {'arch':<12} {'layers':>6} {'d':>5} {'vocab':>7}  {'offline':<7} {'cached':<6}  source"
    print(header)
    for r in rows:
        cached = "-" if r["converted"] is None else ("yes" if r["converted"] else "no")
        print(
            f"{r['alias']:<18} {r['architecture']:<12} {r['layers']:>6} {r['hidden_size']:>5} "
            f"{r['vocab_size']:>7}  {'yes' if r['available_offline'] else 'no':<7} {cached:<6}  {r['source']}"
        )
    print("\nAlso accepted: a Hugging Face hub id (org/name), a local model directory or a .gguf file.")
    return 0


def _prepare(args: argparse.Namespace) -> None:
    """``--prepare``: the model converted, then what the other options ask for, an unknown layer refused first."""
    from ..models.registry import resolve

    spec = resolve(args.prepare)
    convertible = spec is not None and spec.kind == "gguf-package"
    model = functools.cache(lambda: load_model(args.prepare, dtype=args.dtype, device=args.device))  # loaded once
    print(f"{spec.alias}: ready in {sources.convert(spec)}" if convertible else f"{args.prepare}: nothing to convert")
    # an unknown layer: a one-line error before any long work
    tables = model().probe.layers(args.tables) if args.tables else []
    if args.reader:
        model().probe.layers(args.reader)
    if convertible and args.signature:
        _layer_signature(model())
    if args.inversion:
        _prepare_inversion(args.prepare, model())
    if tables:
        _tables(args.prepare, model(), tables)
    if args.reader:
        _train_readers(args, model())


def _layer_signature(model: LoadedModel) -> None:
    """The model's layer signature in ``--dtype``, cached now (about 7 s the first time on a 2-core CPU), so that the
    first capture given without its layer is answered in seconds."""
    from ..invert.layerfit import signature

    signature(model)


def _prepare_inversion(alias: str, model: LoadedModel) -> None:
    """What inversion would build on first use (:func:`lminvert.invert.preparation.prepare`), made now."""
    from ..invert.preparation import prepare

    for line in prepare(model):
        print(f"{alias}: {line}")


def _tables(alias: str, model: LoadedModel, layers: list[Layer]) -> None:
    """The first-position tables of ``layers``, those not kept built in one pass of the vocabulary
    (:func:`lminvert.invert.tables.first_position_tables`)."""
    from ..invert.tables import first_position_tables

    first_position_tables(model, layers)
    print(f"{alias}: first-position tables of layers {', '.join(layer.name for layer in layers)} ({model.dtype}) kept")


def _train_readers(args: argparse.Namespace, model: LoadedModel) -> None:
    layers = model.probe.layers(args.reader)
    wanted = []
    for layer in layers:
        path = table_path(model, layer, reader.KIND)
        if path.is_file() and not args.retrain:  # idempotent: `make readers` run twice trains nothing the second time
            print(f"{args.prepare}: reading network for layer {layer.name} already cached in {path} (--retrain: again)")
        else:
            wanted.append(layer)
    products = {None: None, "auto": None, "float32": False, "bfloat16": True}[args.products]
    options = {"negatives": args.negatives, "random": args.random_prompts, "bfloat16": products}
    # one pass of forwards for all of them (each layer's network is cached as soon as it is trained)
    for layer in reader.train_readers(model, wanted, **{k: v for k, v in options.items() if v is not None}):
        print(f"{args.prepare}: reading network for layer {layer.name} cached")
