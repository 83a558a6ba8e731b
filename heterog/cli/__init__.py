"""The ``heterog`` command line (also ``python -m heterog``): capture, simulate, compare, plan, import-plan, run,
fidelity, bench.

Every subcommand has ``--help``; ``--json`` prints one JSON document on stdout. Bad input exits non-zero with
a one-line message naming what is wrong.

One module per subcommand, each with ``register(subparsers)`` adding its parser and the function that runs
it; ``args`` holds the arguments they share, ``output`` the one JSON emitter, and every table comes from
``heterog.reporting``.
"""
from __future__ import annotations

import argparse
import sys

from heterog.cli import bench, capture, compare, fidelity, import_plan, main_job, plan, run, simulate
from heterog.errors import HeterogError

COMMANDS = (capture, simulate, bench, main_job, compare, plan, import_plan, run, fidelity)     # in --help's order


def build_parser() -> argparse.ArgumentParser:
    """The ``heterog`` parser with every subcommand of ``COMMANDS``."""
    ap = argparse.ArgumentParser(prog="heterog", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a HeterogError becomes one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except HeterogError as exc:
        print(f"heterog {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"heterog {args.cmd}: interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "build_parser", "main"]
