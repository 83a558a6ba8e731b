"""Model references: a zoo name ("bert_large") or a file reference ("path/to/file.py:build"), resolved to
a function ``model_fn(batch_size=None, *, device=None) -> (module, example_inputs)``."""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from heterog.errors import HeterogError, ModelError

ModelFn = Callable[..., tuple[Any, tuple]]


def is_file_ref(ref: str) -> bool:
    """True for "file.py", "file.py:fn" (and any ref whose part before the last colon is a .py path)."""
    path = ref.rsplit(":", 1)[0] if ":" in ref else ref
    return path.endswith(".py")


def split_file_ref(ref: str) -> tuple[Path, str]:
    """("path/to/file.py", "build") from "path/to/file.py:build" (function defaults to build)."""
    if ref.endswith(".py"):
        return Path(ref), "build"
    path, _, fn = ref.rpartition(":")
    return Path(path), fn or "build"


def model_name(ref: str) -> str:
    """A short name for graphs and cache files: the zoo name or the file's stem."""
    if is_file_ref(ref):
        path, fn = split_file_ref(ref)
        return path.stem if fn == "build" else f"{path.stem}.{fn}"
    return ref


def load_model_fn(ref: str) -> ModelFn:
    """Resolve ``ref`` to ``model_fn(batch_size=None, *, device=None) -> (module, example_inputs)``.

    Zoo names call ``heterog.zoo.build(name, batch_size or default_batch_size(name), device=device)``.
    File references import the file and call ``build()`` or ``build(batch_size)`` (with ``device`` set as
    the default torch device while it runs, e.g. "meta" to allocate nothing). Raises HeterogError naming a
    missing file, a missing function or an unknown zoo name; ModelError for a build that breaks the model
    contract.
    """
    if not isinstance(ref, str) or not ref:
        raise HeterogError(f"model reference must be a zoo name or path/to/file.py:build, got {ref!r}")
    if is_file_ref(ref):
        return _file_model_fn(ref)
    return _zoo_model_fn(ref)


def _zoo_model_fn(name: str) -> ModelFn:
    try:
        from heterog import zoo
    except ImportError as exc:
        raise HeterogError(f"model {name!r}: the model zoo cannot be imported ({exc})") from exc
    known = list(zoo.names())
    if name not in known:
        raise HeterogError(f"unknown model {name!r}: not a zoo model (known: {', '.join(known)}) and not a file "
                           "reference (path/to/file.py:build)")

    def model_fn(batch_size: int | None = None, *, device: Any = None) -> tuple[Any, tuple]:
        bs = zoo.default_batch_size(name) if batch_size is None else int(batch_size)
        return _check_built(zoo.build(name, bs, device=device), name, batch_size)

    return model_fn


def _file_model_fn(ref: str) -> ModelFn:
    path, fn_name = split_file_ref(ref)
    if not path.is_file():
        raise HeterogError(f"model file {str(path)!r} does not exist (reference {ref!r})")
    module = _import_file(path)
    build = getattr(module, fn_name, None)
    if build is None:
        raise HeterogError(f"model file {str(path)!r} has no function {fn_name!r} (a reference looks like "
                           "path/to/file.py:build)")
    if not callable(build):
        raise HeterogError(f"{fn_name!r} in {str(path)!r} is a {type(build).__name__}, not a function")
    takes_batch = _accepts_argument(build)

    def model_fn(batch_size: int | None = None, *, device: Any = None) -> tuple[Any, tuple]:
        import torch

        if batch_size is not None and not takes_batch:
            raise ModelError(f"{ref}: {fn_name}() takes no batch size, so batch {batch_size} cannot be "
                             f"built; define {fn_name}(batch_size) or leave the batch size out")
        args = () if batch_size is None or not takes_batch else (int(batch_size),)
        try:
            if device is None:
                built = build(*args)
            else:
                with torch.device(device):
                    built = build(*args)
        except HeterogError:
            raise
        except Exception as exc:
            raise ModelError(f"{ref}: {fn_name}({', '.join(map(str, args))}) failed: "
                             f"{type(exc).__name__}: {exc}") from exc
        return _check_built(built, ref, batch_size)

    return model_fn


def _import_file(path: Path) -> Any:
    resolved = path.resolve()
    mod_name = "heterog_user_model_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise HeterogError(f"model file {str(path)!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise ModelError(f"importing model file {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _accepts_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _check_built(built: Any, ref: str, batch_size: int | None) -> tuple[Any, Any]:
    """(module, inputs): inputs a tuple of tensors whose dim 0 is the batch, or a dict of keyword arguments
    (``heterog.graph.inputs``)."""
    from torch import nn

    from heterog.graph.inputs import input_spec

    if not (isinstance(built, (tuple, list)) and len(built) == 2):
        raise ModelError(f"{ref}: build must return (module, example_inputs), got {type(built).__name__}")
    module, inputs = built
    if not isinstance(module, nn.Module):
        raise ModelError(f"{ref}: build returned a {type(module).__name__} as the module, not a torch.nn.Module")
    try:
        spec = input_spec(inputs)
    except ModelError as exc:
        raise ModelError(f"{ref}: {exc}") from None
    if batch_size is not None and spec.batch_size != int(batch_size):
        raise ModelError(f"{ref}: asked for batch {batch_size}, but the example inputs have batch "
                         f"{spec.batch_size} on dimension 0")
    return module, inputs if isinstance(inputs, Mapping) else spec.flatten(inputs)
