"""Write-then-rename helpers so that nothing already written is lost or half-written."""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Call ``write(fileobj)`` on a temporary file next to ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data), mode="wb")


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> Path:
    """JSON to ``path``; gzip-compressed when the name ends in ``.gz``."""
    text = json.dumps(obj, indent=indent).encode()
    if str(path).endswith(".gz"):
        text = gzip.compress(text, mtime=0)
    return atomic_write_bytes(path, text)


def read_json(path: str | os.PathLike) -> Any:
    """Read JSON (gzip detected by magic bytes)."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data)


def read_json_file(path: str | os.PathLike, what: str, error: type[Exception]) -> Any:
    """The JSON in ``path``, or ``error`` naming ``what`` the file is and why it cannot be read (missing,
    not JSON)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist")
    try:
        return read_json(p)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is a bad file
        raise error(f"{what} {str(p)!r} is not valid JSON ({type(exc).__name__})") from None
