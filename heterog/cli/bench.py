"""``heterog bench``: the simulator and evaluation benchmarks (``heterog.bench``)."""
from __future__ import annotations

import argparse

from heterog.cli.output import add_json_flag, emit


def cmd_bench(args: argparse.Namespace) -> int:
    from heterog.bench import run_bench
    from heterog.reporting import key_values

    out = run_bench(quick=args.quick)
    emit(args, out, key_values(out))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="simulator and evaluation benchmarks")
    p.add_argument("--quick", action="store_true", help="smaller sizes (for tests)")
    add_json_flag(p)
    p.set_defaults(fn=cmd_bench)
