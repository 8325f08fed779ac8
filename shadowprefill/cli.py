"""`shadowprefill` command line (also `python -m shadowprefill`): one sub-command family per subsystem.

Each subsystem module exposes ``register(subparsers)``, which adds its sub-commands and sets ``func`` on
them; this file only collects them (DESIGN.md §5: cli -> serve | sim | gateway). A bad argument or input
file is one line `shadowprefill <command>: error: ...` and exit status 2 (`shadowprefill.usage`).
"""
from __future__ import annotations

import importlib
import sys

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


def build_parser() -> Parser:
    parser = Parser(prog="shadowprefill",
                    description="Shadow prefill for agentic LLM serving with per-step model routing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBSYSTEMS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `shadowprefill ARGV...`; returns the exit status (2 for a bad argument or input file)."""
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
