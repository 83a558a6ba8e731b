"""What the experiments' command lines share: a parser named after the module and described by its
docstring, and the ``MODEL:BATCH`` graph specs (one, or a comma-separated list)."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.reporting import Table


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, described by the first paragraph of ``doc``."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def model_batch(spec: str) -> tuple[str, int]:
    """``"resnet50:128"`` -> ("resnet50", 128); a HeterogError names a malformed spec."""
    model, _, batch = spec.strip().partition(":")
    if not model or not batch.isdigit() or int(batch) < 1:
        raise HeterogError(f"graph {spec!r} must be MODEL:BATCH, e.g. resnet50:128")
    return model, int(batch)


def model_batch_list(specs: str) -> list[tuple[str, int]]:
    """``"vgg19:192,bert_large:48"`` -> [("vgg19", 192), ("bert_large", 48)]."""
    return [model_batch(s) for s in specs.split(",") if s.strip()]


def argparse_type(parse):
    """``parse`` as an argparse ``type=``: its HeterogError becomes a usage error (exit 2)."""
    def checked(text: str):
        try:
            return parse(text)
        except HeterogError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    checked.__name__ = parse.__name__
    return checked


def print_rows(rows: list[dict], as_json: bool, table: Callable[[list[dict]], Table]) -> int:
    """A table script's output: its rows as JSON, or ``table(rows)`` as Markdown; the exit code (0)."""
    print(json.dumps(rows, indent=1) if as_json else table(rows).markdown())
    return 0
