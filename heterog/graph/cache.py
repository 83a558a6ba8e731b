"""Graph cache: capture a model reference (zoo name or file.py:build) once per content hash and keep the
OpGraph as gzip JSON under .heterog-cache/graphs, written atomically."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

from heterog.errors import GraphError, HeterogError, ModelError
from heterog.graph.modelref import is_file_ref, load_model_fn, model_name, split_file_ref
from heterog.graph.opgraph import OpGraph, load_graph

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = ".heterog-cache/graphs"


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def capture_sources() -> list[Path]:
    """The code a captured graph depends on: every module of the graph package (tracing, fusion, the
    normalisers, FLOP formulas, the optimizer step, ...) and the placement vocabulary its split options are
    written in (``heterog.placement``), so that a change to any of them captures again."""
    here = Path(__file__).parent
    return sorted([*here.glob("*.py"), here.parent / "placement.py"])


def cache_key(ref: str, batch_size: int | None, optimizer: str, fuse: bool, lr: float = 0.01) -> str:
    """Content hash of everything the captured graph depends on.

    The model reference, the file's content (file refs) or the zoo's sources (zoo names), the batch size,
    optimizer, learning rate, fusion flag, torch version, ``CAPTURE_VERSION`` and the capture code itself
    (``capture_sources``).
    A file model's own imports are not followed: edit the referenced file (or pass use_cache=False).
    """
    import torch

    from heterog.graph.capture import CAPTURE_VERSION

    here = Path(__file__).parent
    if is_file_ref(ref):
        path, fn = split_file_ref(ref)
        model_digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        model_part = {"file": path.name, "function": fn, "content": model_digest}
    else:
        zoo_dir = here.parent / "zoo"
        model_part = {"zoo": ref, "sources": _digest_files(list(zoo_dir.glob("*.py")))}
    key = {
        "model": model_part, "batch_size": batch_size, "optimizer": optimizer, "fuse": bool(fuse),
        "lr": float(lr), "torch": torch.__version__, "capture_version": CAPTURE_VERSION,
        "code": _digest_files(capture_sources()),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | Path, ref: str, batch_size: int | None, optimizer: str, key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name(ref))
    batch = "default" if batch_size is None else str(batch_size)
    return Path(cache_dir) / f"{safe}-b{batch}-{optimizer}-{key[:16]}.json.gz"


def capture_model(ref: str, batch_size: int | None = None, optimizer: str = "sgd", *, fuse: bool = True,
                  cache_dir: str | Path = DEFAULT_CACHE_DIR, use_cache: bool = True, lr: float = 0.01) -> OpGraph:
    """The OpGraph of model ``ref`` at ``batch_size`` (None: the zoo default / what build() returns).

    A cached graph with the same ``cache_key`` is returned without tracing; otherwise the model is built
    on the meta device (no memory; on the default device if its build cannot run on meta), captured and
    written to the cache (gzip JSON, write-then-rename). ``use_cache=False`` captures afresh and refreshes
    the cache file. A corrupt cache file is replaced.
    """
    from heterog.graph.capture import OPTIMIZERS, capture

    if optimizer not in OPTIMIZERS:
        raise HeterogError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    if batch_size is not None and int(batch_size) <= 0:
        raise HeterogError(f"batch size must be positive, got {batch_size}")
    model_fn = load_model_fn(ref)
    if batch_size is None and not is_file_ref(ref):
        from heterog import zoo

        batch_size = int(zoo.default_batch_size(ref))
    key = cache_key(ref, batch_size, optimizer, fuse, lr)
    path = cache_path(cache_dir, ref, batch_size, optimizer, key)
    if use_cache and path.is_file():
        try:
            graph = load_graph(path)
            log.info("graph cache hit: %s", path)
            return graph
        except GraphError as exc:
            log.warning("ignoring unreadable cached graph (%s); capturing again", exc)

    t0 = time.perf_counter()
    try:
        module, inputs = model_fn(batch_size, device="meta")
    except ModelError as exc:
        log.info("%s cannot be built on the meta device (%s); building it for real", ref, exc)
        module, inputs = model_fn(batch_size)
    graph = capture(module, inputs, optimizer=optimizer, lr=lr, fuse=fuse, name=model_name(ref))
    graph.meta.update({"model": ref, "cache_key": key, "capture_time_s": round(time.perf_counter() - t0, 4)})
    graph.save(path)
    log.info("captured %s in %.1f s -> %s", ref, graph.meta["capture_time_s"], path)
    return graph
