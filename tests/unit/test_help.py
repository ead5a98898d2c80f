"""Every `lminvert [COMMAND] --help` ends with examples a user can copy, and every example still parses.

The commands are discovered from the parser (a new command without examples fails here); an example whose option
was renamed or removed, or whose arguments no longer parse, fails too. Parsing opens no file and loads no model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest

from lminvert.cli import build_parser

PARSER = build_parser()
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


COMMANDS = _commands(PARSER)
ALL_OPTIONS = set(PARSER._option_string_actions).union(*(p._option_string_actions for p in COMMANDS.values()))


def _examples(parser: argparse.ArgumentParser) -> list[str]:
    """The lines after the help's last ``examples:`` header, which must be the help's last lines."""
    lines = parser.format_help().rstrip().splitlines()
    headers = [i for i, line in enumerate(lines) if line == "examples:"]
    assert headers, f"`{parser.prog} --help` has no 'examples:' block"
    block = lines[headers[-1] + 1 :]
    for line in block:
        assert line.startswith("  lminvert "), f"`{parser.prog} --help` does not end with its examples: {line!r}"
    return [line.strip() for line in block]


def _split(line: str) -> tuple[list[str], str]:
    """The example's arguments after ``lminvert`` (a trailing ``# comment`` dropped) and the comment."""
    argv = shlex.split(line, comments=True)
    assert argv[0] == "lminvert", line
    for hash_ in re.finditer(r"(?<=\s)#", line):
        with contextlib.suppress(ValueError):  # ValueError: this '#' is inside quotes
            if shlex.split(line[: hash_.start()]) == argv:
                return argv[1:], line[hash_.start() + 1 :]
    return argv[1:], ""


def _invoked(argv: list[str]) -> str | None:
    return next((a for a in argv if a in COMMANDS), None)


def _check_parses(line: str, argv: list[str]) -> None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            PARSER.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"example does not parse (exit {exc.code}): {line}\n{stderr.getvalue().strip()}")


@pytest.mark.parametrize("name", [None, *COMMANDS], ids=lambda n: n or "lminvert")
def test_help_ends_with_examples_that_parse(name):
    parser = PARSER if name is None else COMMANDS[name]
    examples = _examples(parser)
    assert len(examples) >= 2, f"`{parser.prog} --help` shows {len(examples)} example(s); give two or three"
    if name is not None:
        own = [line for line in examples if _invoked(_split(line)[0]) == name]
        assert len(own) >= 2, f"`{parser.prog} --help`: fewer than two examples run `{parser.prog}` itself"
    for line in examples:
        argv, comment = _split(line)
        command = _invoked(argv)
        assert command is not None, f"example runs no command: {line}"
        allowed = set(PARSER._option_string_actions) | set(COMMANDS[command]._option_string_actions)
        for token in argv:
            option = token.split("=", 1)[0]
            if option.startswith("--"):
                assert option in allowed, f"{option} is not an option of `lminvert {command}`: {line}"
        for option in OPTION.findall(comment):  # a comment may name another command's option, but a real one
            assert option in ALL_OPTIONS, f"the comment names {option}, an option of no command: {line}"
        _check_parses(line, argv)
