"""Command-line usage errors: a bad argument or input file is one line on stderr and exit status 2.

    shadowprefill simulate: error: unknown model 'X'; known: [...]

Every `shadowprefill` command parses with `Parser`, whose argparse errors become `UsageError`, and checks
its arguments and input files (config, sessions, traces) inside `with user_input():`, which turns the
`ValueError` / `TypeError` / `OSError` / JSON and CSV errors raised there into a `UsageError`. `run_cli`
prints a `UsageError` as the line above and returns 2. Work done outside `user_input()` (a simulation, a
server) is not input checking: its exceptions keep their traceback. `SHADOWPREFILL_DEBUG=1` shows the
traceback of a usage error too.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Sequence


class UsageError(Exception):
    """A bad command-line argument or input file; `prog` is the command it belongs to, when known."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `UsageError` (printed by `run_cli` as one line) instead of
    printing the usage and exiting; sub-parsers inherit the class."""

    def error(self, message: str):
        raise UsageError(message, self.prog)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc})"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "missing key"
    return str(exc) or type(exc).__name__


@contextmanager
def user_input(what: str | None = None):
    """Checks of arguments and input files: their errors become one-line `UsageError`s ("what: message")."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, TypeError, KeyError, OSError, csv.Error) as exc:
        message = _describe(exc)
        raise UsageError(f"{what}: {message}" if what else message) from exc


# ---- argparse types: the message names the rule, argparse adds the argument ----------------------------
def _number(kind: type, test: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value
    parse.__name__ = f"{kind.__name__} {rule}"
    return parse


positive_int = _number(int, lambda v: v > 0, "> 0")
nonneg_int = _number(int, lambda v: v >= 0, ">= 0")
positive_float = _number(float, lambda v: v > 0, "> 0")
nonneg_float = _number(float, lambda v: v >= 0, ">= 0")
port = _number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535]")


def comma_list(text: str, kind: type = str, what: str = "value") -> list:
    """`"a, b,c"` -> ["a", "b", "c"] (converted by `kind`); empty items are dropped."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"expected comma-separated {what}s, got {text!r}") from None


# ---- running a command line --------------------------------------------------------------------------
def _tag_commands(parser: argparse.ArgumentParser) -> None:
    """Set `_command` (the prog, e.g. "shadowprefill gateway sweep") on every sub-parser, so errors raised
    while a command runs name it; nested sub-parsers override their parent's value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_command=sub.prog)
                _tag_commands(sub)


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen command's `func(args)`; a `UsageError` is printed as one line
    `<command>: error: <message>` on stderr and returns 2."""
    _tag_commands(parser)
    command = parser.prog
    try:
        args, extra = parser.parse_known_args(argv)
        command = getattr(args, "_command", None) or parser.prog
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}", command)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help(sys.stderr)
            return 2
        return int(func(args) or 0)
    except UsageError as exc:
        if os.environ.get("SHADOWPREFILL_DEBUG") == "1":
            traceback.print_exc()
        print(f"{exc.prog or command}: error: {exc}", file=sys.stderr)
        return 2

