"""The `lminvert` command line: thin wrappers that parse, call the public API and print.

Each subcommand lives in its own module with ``register(subparsers)``; errors caused by the input are
printed as one line (``lminvert: error: ...``) with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..errors import LminvertError

EXAMPLES = """Run `lminvert <command> --help` for its options and examples.

examples:
  lminvert demo                                           # the whole job on smollm2-135m, offline
  lminvert encode --layer 15 --text "my PIN is 4921" --out leak.safetensors
  lminvert invert leak.safetensors                        # the exact prompt, from the states alone
"""

COMMANDS = ["models", "encode", "inspect", "invert", "collisions", "exhaustive", "experiment", "lab", "audit", "report"]
COMMANDS += ["demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lminvert",
        description="Recover prompts from transformer hidden states; test injectivity at scale.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.endswith(f"cli.{name}"):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("lminvert.once").setLevel(logging.INFO)  # a first run's one-time builds, said once each
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        return int(args.func(args) or 0)
    except LminvertError as exc:
        print(f"lminvert: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lminvert: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"lminvert: internal error: {type(exc).__name__}: {detail} (rerun with --debug for the "
            "traceback and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
