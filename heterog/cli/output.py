"""The CLI's one way to print a result: ``--json`` prints one JSON document on stdout, otherwise the text."""
from __future__ import annotations

import argparse
import json
from typing import Any


def _plain(x: Any) -> Any:
    """A value JSON cannot hold as is (numpy scalar, tensor, path): a number as a float, anything else as text."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def dumps(payload: Any) -> str:
    """The JSON document of ``payload`` (indent 1; numpy numbers and paths made plain)."""
    return json.dumps(payload, indent=1, default=_plain)


def emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    """Print ``payload`` as JSON when ``args.json``, else ``text``."""
    print(dumps(payload) if getattr(args, "json", False) else text)


def add_json_flag(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """The ``--json`` flag ``emit`` reads."""
    p.add_argument("--json", action="store_true", help=help)
