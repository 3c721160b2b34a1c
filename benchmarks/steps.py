"""A subcommand made of steps (`orcaserve-bench kernels gemm`, `orcaserve-bench gpu engine`): each
step a module with `add_arguments(parser)` and `run(args) -> dict`, as subcommands are. Only the
chosen step's module is imported (the preflight must run where torch does not import)."""

from __future__ import annotations

import argparse
import importlib


def add(parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]]) -> None:
    from orcaserve.bench import cli

    sub = parser.add_subparsers(dest="step", required=True, metavar="STEP")
    for name, (module, what) in table.items():
        if name not in cli.ARGV:
            sub.add_parser(name, help=what, description=what)
            continue
        mod = importlib.import_module(module)
        sp = sub.add_parser(
            name, help=what, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_arguments(sp)
        cli.add_out(sp)


def run(args: argparse.Namespace, table: dict[str, tuple[str, str]]) -> dict:
    return importlib.import_module(table[args.step][0]).run(args)
