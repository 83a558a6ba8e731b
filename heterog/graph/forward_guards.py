"""Guards around a model's code while its training step is traced: what a captured step cannot follow is
refused in one line that names the model's line, and what it can follow is made to trace.

  - random draws outside torch (``numpy.random``, ``random``) in forward: the trace sees a constant, so
    every step would reuse the draw made at capture (Wav2Vec2's SpecAugment masks drawn with numpy);
  - a module that casts itself inside forward (``self.classifier = self.classifier.to(self.dtype)``):
    a cast to the dtype and device it already has does nothing; any other one would change a parameter's
    dtype in the middle of the step, which a step with fixed parameters cannot do;
  - torch's generator re-seeded by the model (``torch.manual_seed`` in forward, so that a later pass
    redraws the same dropout masks, as reversible layers do): refused when the step draws random values;
  - ``len()`` of a tensor whose first size is the batch gives the symbolic size, not the example's
    number, so that ``torch.arange(len(logits))`` stays a function of the batch size;
  - ops whose output shape depends on tensor values (``aten._ctc_loss``, ``nonzero``) are named with the
    model's line that calls them;
  - tensors the model reads other than through its parameters, buffers and inputs (a plain tensor
    attribute, a module-level constant, a value an ``lru_cache`` kept from an eager call) are constants of
    the step; one that is a parameter or buffer read through a reference kept elsewhere (a list, a closure)
    would never be trained or updated, and is refused naming it (``refuse_state_constants``);
  - what the model's code keeps while traced holds the trace's fake tensors or symbolic sizes, which the next
    eager call of the model would read: the plain attributes and buffers of every module are put back as they
    were (a rotary table registered in forward for a longer sequence, and the length it was made for), and the
    ``functools`` caches of the model's code that the trace filled are emptied: capture leaves the model as
    it found it.

Hand-written backwards (``torch.autograd.Function``) are traced by ``heterog.graph.tracing``: the module's
parameters stay substituted while the backward runs, and gradients a backward writes into ``param.grad``
are added to those autograd returns.
"""
from __future__ import annotations

import builtins
import functools
import inspect
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from heterog.errors import ModelError

_HERE = Path(__file__).resolve().parent.parent          # the heterog package
_SKIPPED = tuple(str(p) for p in (Path(torch.__file__).resolve().parent, Path(np.__file__).resolve().parent, _HERE,
                                   Path(random.__file__).resolve()))
# module-level numpy.random names that do not draw (classes, seeding and state are drawn through, or refused, below)
_NUMPY_KEEP = frozenset({"BitGenerator", "Generator", "MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64",
                         "SeedSequence", "bit_generator", "get_bit_generator", "set_bit_generator", "get_state"})
_RANDOM_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
                 "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate", "betavariate",
                 "paretovariate", "weibullvariate", "triangular", "getrandbits", "randbytes", "seed")
_CASTS = ("to", "float", "double", "half", "bfloat16", "type")


def outside_library(filename: str) -> bool:
    """The file is the model's own code (not torch, numpy, the standard ``random`` module or heterog)."""
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return not filename.startswith("<") and not path.startswith(_SKIPPED)


def model_line(frames: list[tuple[str, int, str, str | None]] | None = None) -> str:
    """``file:line in function() (code)`` of the innermost frame of the model's own code: of ``frames`` ((file,
    line, function, code) innermost last; a traceback's), or of the current stack; "" when there is none."""
    if frames is None:
        frames = [(f.filename, f.lineno or 0, f.name, f.line) for f in traceback.extract_stack()]
    for filename, lineno, function, code in reversed(frames):
        if outside_library(filename):
            where = f"{filename}:{lineno} in {function}()"
            return f"{where} ({code.strip()})" if code else where
    return ""


def traceback_line(exc: BaseException) -> str:
    """``model_line`` of the traceback of ``exc``."""
    return model_line([(f.filename, f.lineno or 0, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)])


def _called_from_model(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return outside_library(frame.f_code.co_filename)


class ForwardGuards:
    """The guards of the module docstring, installed while a step of ``module`` (named ``model_name``) is
    traced: ``with ForwardGuards(...).installed():``. ``seeded`` lists where the model re-seeded torch's
    generator (``refuse_reseeding`` turns that into an error when the step draws random values)."""

    def __init__(self, module: nn.Module, model_name: str) -> None:
        self.model_name = model_name
        self.module = module
        self.paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        self.seeded: list[str] = []

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, value: Any) -> None:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

        for name in dir(np.random):
            fn = getattr(np.random, name)
            if not name.startswith("_") and callable(fn) and name not in _NUMPY_KEEP:
                patch(np.random, name, self._refuse_draw(fn, f"numpy.random.{name}"))
        for name in _RANDOM_DRAWS:
            if hasattr(random, name):
                patch(random, name, self._refuse_draw(getattr(random, name), f"random.{name}"))
        for name in _CASTS:
            patch(nn.Module, name, self._cast_guard(getattr(nn.Module, name), name))
        patch(torch, "manual_seed", self._note_seed(torch.manual_seed))
        patch(torch.random, "manual_seed", self._note_seed(torch.random.manual_seed))
        patch(builtins, "len", _symbolic_len(builtins.len))
        modules = list(dict.fromkeys(self.module.modules()))
        kept = [(d, dict(d)) for m in modules for d in (vars(m), m._buffers)]
        caches = {c: c.cache_info().misses for c in _code_caches(modules)}
        try:
            yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)
            for d, before in kept:     # attributes and buffers as they were: the trace made the new ones
                if any(name not in before or before[name] is not value for name, value in d.items()) or \
                        len(d) != len(before):
                    d.clear()
                    d.update(before)
            for cache, misses in caches.items():    # caches filled while traced
                if cache.cache_info().misses != misses:
                    cache.cache_clear()

    # ------------------------------------------------------------------ the guards
    def _refuse_draw(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        model = self.model_name

        def guard(*args: Any, **kwargs: Any) -> Any:
            if not _called_from_model():
                return fn(*args, **kwargs)
            raise ModelError(f"model {model} draws random values with {what} at {model_line()} inside forward; a "
                             "captured step would reuse the values drawn at capture on every step: draw with torch "
                             "(torch.rand, torch.bernoulli) or turn this option off")
        return guard

    def _cast_guard(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        guards = self

        def cast(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not _called_from_model():
                return method(mod, *args, **kwargs)
            dtype, device = _cast_target(name, args, kwargs)
            tensors = [t for t in [*mod.parameters(), *mod.buffers()] if isinstance(t, torch.Tensor)]
            differ = [t for t in tensors if (dtype is not None and t.is_floating_point() and t.dtype != dtype)
                      or (device is not None and t.device.type != torch.device(device).type)]
            if not differ:
                return mod                     # already what it asks for: the cast does nothing
            path = guards.paths.get(id(mod), "")
            has = sorted({str(t.dtype).removeprefix("torch.") for t in differ})
            want = str(dtype).removeprefix("torch.") if dtype is not None else str(device)
            raise ModelError(f"model {guards.model_name}: module '{path}' ({type(mod).__name__}) casts itself to "
                             f"{want} inside forward at {model_line()}, its parameters being {', '.join(has)}; a "
                             "captured step keeps every parameter's dtype and device: cast the model before "
                             "training instead")
        return cast

    def _note_seed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def seed(*args: Any, **kwargs: Any) -> Any:
            if _called_from_model():
                self.seeded.append(model_line())
            return fn(*args, **kwargs)
        return seed

    def refuse_reseeding(self, draws_random: bool) -> None:
        """Refuse a step that draws random values of a model that re-seeds torch's generator in forward."""
        if self.seeded and draws_random:
            raise ModelError(f"model {self.model_name} re-seeds torch's random generator inside forward at "
                             f"{self.seeded[0]}, so that a later pass (a recomputation in backward) draws the "
                             "same values again; a captured step draws each random op from a stream of its own, "
                             "so those values would differ: train it with dropout off (probabilities 0)")


def refuse_state_constants(constants: list[torch.Tensor], module: nn.Module, model_name: str) -> None:
    """Refuse a step whose ``constants`` (the values of its ``get_attr`` nodes) include a parameter or buffer
    of ``module``: read through a reference kept outside the module's attributes, it would stay constant."""
    held: dict[int, tuple[str, str]] = {}
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.numel() and not isinstance(t, FakeTensor):
                held.setdefault(t.untyped_storage().data_ptr(), (kind, name))
    for c in constants:
        if isinstance(c, torch.Tensor) and c.numel() and not isinstance(c, FakeTensor):
            found = held.get(c.untyped_storage().data_ptr())
            if found is not None:
                kind, name = found
                raise ModelError(f"model {model_name} reads {kind} '{name}' through a reference it keeps outside "
                                 "its modules' attributes (a list, a dict, a closure); a captured step sees it as "
                                 f"a constant and would never {'train' if kind == 'parameter' else 'update'} it: "
                                 f"read it as the module's attribute (self.{name})")


def _code_caches(modules: list[nn.Module]) -> list[Any]:
    """The ``functools.lru_cache`` (and ``cache``) wrappers of the model's own code: in the classes of
    ``modules`` (and their bases) outside torch, and in their modules' globals; found through decorators
    that wrap them (``__wrapped__``, closures; transformers' ``compile_compatible_method_lru_cache``)."""
    found: dict[int, Any] = {}

    def visit(obj: Any, depth: int = 0) -> None:
        if depth > 3:
            return
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, functools._lru_cache_wrapper):
            found[id(obj)] = obj
        if callable(obj):
            inner = getattr(obj, "__wrapped__", None)
            if inner is not None:
                visit(inner, depth + 1)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:                  # an empty cell
                    pass

    classes = {c for m in modules for c in type(m).__mro__ if c.__module__ and not c.__module__.startswith("torch")}
    for c in classes:
        try:
            if not outside_library(inspect.getfile(c)):
                continue
        except (TypeError, OSError):
            continue
        for v in vars(c).values():
            visit(v)
        for v in list(vars(sys.modules[c.__module__]).values()) if c.__module__ in sys.modules else ():
            if inspect.isfunction(v) or isinstance(v, functools._lru_cache_wrapper):
                visit(v)
    return list(found.values())


def _cast_target(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.dtype | None, Any]:
    """(dtype, device) a module cast ``name`` asks for (None: left as it is)."""
    if name == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return dtype, device
    if name == "type":
        dst = args[0] if args else kwargs.get("dst_type")
        return (dst if isinstance(dst, torch.dtype) else None), None
    return {"float": torch.float32, "double": torch.float64, "half": torch.float16,
            "bfloat16": torch.bfloat16}[name], None


def _symbolic_len(real_len: Callable[[Any], int]) -> Callable[[Any], Any]:
    """``len`` that gives a tensor's symbolic first size (the batch) when the model's own code asks for it."""
    def length(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0:
            size = obj.shape[0]
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols and _called_from_model():
                return size
        return real_len(obj)
    return length


def shape_error_message(exc: BaseException, model_name: str) -> str | None:
    """One line for a trace that stopped at an op whose output shape depends on tensor values (``nonzero``,
    ``aten._ctc_loss``, boolean indexing), naming the op and the model's line; None for other errors."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    if not isinstance(exc, DynamicOutputShapeException):
        return None
    op = str(exc.args[0]) if exc.args else "an op"
    where = traceback_line(exc)
    return (f"model {model_name}: {op} has an output shape that depends on tensor values"
            f"{' at ' + where if where else ''}; a training step is captured once for all inputs, so its "
            "shapes must follow from the input shapes (pad to a fixed size, or mask instead of selecting)")
