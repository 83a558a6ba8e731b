"""``heterog capture MODEL -o GRAPH.json``: capture a model's training step into a graph file."""
from __future__ import annotations

import argparse

from heterog.cli.output import add_json_flag, emit


def cmd_capture(args: argparse.Namespace) -> int:
    from heterog.graph.cache import capture_model

    g = capture_model(args.model, args.batch_size, args.optimizer, fuse=not args.no_fuse, use_cache=not args.no_cache)
    g.save(args.output)
    s = g.summary()
    text = (f"captured {args.model} (batch {g.batch_size}, {g.optimizer}): {s['ops']} ops "
            f"({s['compute_ops']} compute), {s['edges']} edges, {s['params']:,} params -> {args.output}")
    if g.meta.get("inputs_without_batch"):
        text += f"\ninputs without the batch (whole on every replica): {', '.join(g.meta['inputs_without_batch'])}"
    if g.meta.get("random_ops"):
        text += f"\nops drawing random values (dropout): {g.meta['random_ops']}"
    if g.meta.get("coupled_ops"):
        text += f"\nops coupling samples (run once over the whole batch): {g.meta['coupled_ops']}"
    for a in g.assumptions:
        text += f"\nassumes on every step's inputs: {a['code']} is {a['holds']} (the model's check at {a['where']})"
    emit(args, {**s, "output": str(args.output), "meta": g.meta, "assumptions": g.assumptions}, text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="capture a model's training step into a graph file")
    p.add_argument("model", help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--no-fuse", action="store_true", help="keep zero-cost view ops as separate ops")
    p.add_argument("--no-cache", action="store_true", help="capture again even if a cached graph exists")
    p.add_argument("-o", "--output", required=True, help="graph file to write (.json or .json.gz)")
    add_json_flag(p)
    p.set_defaults(fn=cmd_capture)
