"""`shadowprefill` command line: one sub-command family per subsystem.

Each subsystem module exposes ``register(subparsers)``, which adds its sub-commands and sets
``func`` on them; this file only collects them (DESIGN.md §5: cli -> serve | sim | gateway).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# module path -> sub-commands it registers (imported lazily so `shadowprefill --help` stays fast)
SUBSYSTEMS = [
    "shadowprefill.engine_demo",
    "shadowprefill.selfcheck",
    "shadowprefill.gateway.cli",
    "shadowprefill.serve.cli",
    "shadowprefill.sim.cli",
    "shadowprefill.sim.study",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shadowprefill",
        description="Shadow prefill for agentic LLM serving with per-step model routing.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBSYSTEMS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
