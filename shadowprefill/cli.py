"""`shadowprefill` command line (also `python -m shadowprefill`): one sub-command family per subsystem.

Each subsystem module exposes ``register(subparsers)``, which adds its sub-commands and sets ``func`` on
them; this file only collects them (DESIGN.md §5: cli -> serve | sim | gateway). A bad argument or input
file is one line `shadowprefill <command>: error: ...` and exit status 2 (`shadowprefill.usage`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from shadowprefill import __version__
from shadowprefill.usage import Parser, run_cli

# module path -> sub-commands it registers (imported lazily so `shadowprefill --help` stays fast)
SUBSYSTEMS = [
    "shadowprefill.engine_demo",
    "shadowprefill.selfcheck",
    "shadowprefill.gateway.cli",
    "shadowprefill.serve.cli",
    "shadowprefill.sim.cli",
    "shadowprefill.sim.study",
]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or "%(default)" in text or default is None or default is False
                or default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def explain_defaults(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and all its sub-parsers `HelpFormatter` (sub-parsers do not inherit a formatter)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                explain_defaults(sub)


def build_parser() -> Parser:
    parser = Parser(prog="shadowprefill",
                    description="Shadow prefill for agentic LLM serving with per-step model routing. "
                                "`shadowprefill COMMAND --help` explains a command; README.md has a quick start "
                                "for each way in.")
    parser.add_argument("--version", action="version", version=f"shadowprefill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBSYSTEMS:
        importlib.import_module(module_name).register(sub)
    explain_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `shadowprefill ARGV...`; returns the exit status (2 for a bad argument or input file)."""
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
