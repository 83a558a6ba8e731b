"""How the runtime calls traced fx nodes: picklable calls (``NodeCall``, arguments that name other nodes'
values ``Ref`` or sizes ``SymRef``), their targets by name, and ``Kernel``, the nodes of one op run in
order (random nodes drawing for the instance's samples, ``heterog.runtime.rng``)."""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from heterog.errors import HeterogError
from heterog.graph.shard_exec import local_size, local_transform
from heterog.runtime.memory import exclusive
from heterog.runtime.rng import Draw, RandomNode, call_random

if TYPE_CHECKING:  # pragma: no cover
    from heterog.runtime.instructions import Local


class Ref:
    """An argument that is the value of fx node ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[type[Ref], tuple[str]]:
        return (Ref, (self.name,))

    def __repr__(self) -> str:
        return f"%{self.name}"


class LocalSize:
    """A size argument of a node of an op divided beyond the batch: ``inner``'s value (a constant, a
    ``SymRef`` or a list of them) as a device holding ``share`` of ``extent`` units passes it
    (``heterog.graph.shard_exec.local_size``)."""

    __slots__ = ("inner", "index", "share", "extent", "node")

    def __init__(self, inner: Any, index: int | None, share: int, extent: int | None, node: str) -> None:
        self.inner, self.index, self.share, self.extent, self.node = inner, index, share, extent, node

    def __reduce__(self) -> tuple[type[LocalSize], tuple[Any, ...]]:
        return (LocalSize, (self.inner, self.index, self.share, self.extent, self.node))


class SymRef:
    """An argument that is a size computed from the batch (fx shape node ``name``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[type[SymRef], tuple[str]]:
        return (SymRef, (self.name,))

    def __repr__(self) -> str:
        return f"#{self.name}"


def target_name(target: Any) -> str:
    """A string that ``resolve_target`` turns back into ``target`` (OpOverloads do not pickle)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"op:{target._schema.name}.{target._overloadname}"
    module = getattr(target, "__module__", None) or "builtins"
    if module == "_operator":
        module = "operator"
    return f"py:{module}:{target.__qualname__}"


_TARGETS: dict[str, Callable[..., Any]] = {}


def resolve_target(name: str) -> Callable[..., Any]:
    fn = _TARGETS.get(name)
    if fn is not None:
        return fn
    kind, _, rest = name.partition(":")
    found: Any
    if kind == "op":
        qual, _, overload = rest.rpartition(".")
        ns, _, op = qual.partition("::")
        found = getattr(getattr(getattr(torch.ops, ns), op), overload)
    elif kind == "py":
        module, _, qualname = rest.partition(":")
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    else:
        raise HeterogError(f"cannot resolve fx target {name!r}")
    _TARGETS[name] = found
    return found


@dataclass
class NodeCall:
    """One fx node: ``target(*args, **kwargs)`` with Ref/SymRef placeholders in the arguments."""

    name: str
    target: str
    args: tuple
    kwargs: dict


def lower_arg(a: Any, shape_nodes: frozenset[str]) -> Any:
    from torch.fx import Node

    if isinstance(a, Node):
        return SymRef(a.name) if a.name in shape_nodes else Ref(a.name)
    if isinstance(a, tuple):
        return tuple(lower_arg(x, shape_nodes) for x in a)
    if isinstance(a, list):
        return [lower_arg(x, shape_nodes) for x in a]
    if isinstance(a, dict):
        return {k: lower_arg(v, shape_nodes) for k, v in a.items()}
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise HeterogError("captured graph has a symbolic size that is not an fx node; cannot lower it")
    return a


def _has_ref(a: Any) -> bool:
    if isinstance(a, (Ref, SymRef, LocalSize)):
        return True
    if isinstance(a, (tuple, list)):
        return any(_has_ref(x) for x in a)
    if isinstance(a, dict):
        return any(_has_ref(x) for x in a.values())
    return False


def _resolve(a: Any, env: dict, sym: dict) -> Any:
    t = type(a)
    if t is Ref:
        return env[a.name]
    if t is SymRef:
        return sym[a.name]
    if t is LocalSize:
        return local_size(_resolve(a.inner, env, sym), a.index, a.share, a.extent, a.node)
    if t is tuple:
        return tuple(_resolve(x, env, sym) for x in a)
    if t is list:
        return [_resolve(x, env, sym) for x in a]
    if t is dict:
        return {k: _resolve(v, env, sym) for k, v in a.items()}
    return a


def _arguments(args: tuple, kwargs: dict, env: dict, sym: dict) -> tuple[tuple, dict]:
    return _resolve(args, env, sym), _resolve(kwargs, env, sym)


def call_arguments(call: NodeCall, env: dict, sym: dict) -> tuple[tuple, dict]:
    """The arguments of node ``call`` given the values ``env`` and sizes ``sym``."""
    return _arguments(call.args, call.kwargs, env, sym)


def _retarget_device(a: Any, device: torch.device) -> Any:
    """Replace torch.device constants (``ones(..., device=cpu)``) by the worker's device."""
    if isinstance(a, torch.device):
        return device
    if isinstance(a, tuple):
        return tuple(_retarget_device(x, device) for x in a)
    if isinstance(a, list):
        return [_retarget_device(x, device) for x in a]
    if isinstance(a, dict):
        return {k: _retarget_device(v, device) for k, v in a.items()}
    return a


def _describe_inputs(args: tuple, env: dict) -> str:
    """Shapes and strides of a call's tensor arguments (error messages)."""
    out = []
    for x in args:
        v = env.get(x.name) if type(x) is Ref else None
        if isinstance(v, torch.Tensor):
            out.append(f"%{x.name} {tuple(v.shape)} stride {tuple(v.stride())}")
    return "; ".join(out) or "none"


class Kernel:
    """The fx nodes of one op, ready to call: ``kernel(env, sym, draw)`` computes them in order into ``env``.

    Random nodes (``random``: name -> RandomNode) draw the values single-device training draws for the
    samples that ``draw`` names (``heterog.runtime.rng``); without a ``draw`` they draw from the process's
    generator, as eager PyTorch does. ``local``: the nodes run on a device's part of an op divided beyond
    the batch (its size arguments and transform, ``heterog.runtime.instructions.Local``)."""

    __slots__ = ("calls", "names", "random", "_out")

    def __init__(self, calls: Sequence[NodeCall], device: torch.device | None = None,
                 random: dict[str, RandomNode] | None = None, local: Local | None = None) -> None:
        self.calls = []
        self.random = {c.name: random[c.name] for c in calls if random and c.name in random}
        for c in calls:
            args, kwargs = c.args, c.kwargs
            if device is not None and device.type != "cpu":
                args, kwargs = _retarget_device(args, device), _retarget_device(kwargs, device)
            fn = resolve_target(c.target)
            if local is not None:
                args = _local_args(args, c.name, local)
                if c.name == local.transform_node and local.transform is not None:
                    fn = functools.partial(local_transform, local.transform, fn, local.share, local.offset,
                                           local.extent)
            simple = not _has_ref(kwargs) and all(type(x) in (Ref, SymRef) or not _has_ref(x) for x in args)
            self.calls.append((c.name, fn, args, kwargs, simple and c.name not in self.random))
        self.names = [c.name for c in calls]
        self._out: dict[str, Callable[..., Any] | None] = {}

    def arguments(self) -> list[tuple[str, tuple[str, ...]]]:
        """Per node, in order: its name and the nodes its positional arguments name."""
        return [(name, tuple(a.name for a in args if type(a) is Ref)) for name, _, args, _, _ in self.calls]

    def out_variant(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """The ``out=`` overload of node ``name``'s target ``fn`` (``aten.add.out`` for ``aten.add.Tensor``),
        None if it has none."""
        if name not in self._out:
            found = None
            if isinstance(fn, torch._ops.OpOverload):
                want = [a.name for a in fn._schema.arguments]
                packet = fn.overloadpacket
                for overload in packet.overloads():
                    cand = getattr(packet, overload)
                    args = cand._schema.arguments
                    if args and args[-1].name == "out" and [a.name for a in args[:-1]] == want:
                        found = cand
                        break
            self._out[name] = found
        return self._out[name]

    def __call__(self, env: dict, sym: dict, draw: Draw | None = None,
                 in_place: tuple[str, tuple[str, ...]] | None = None) -> None:
        """Run the nodes into ``env``. ``in_place``: (node, inputs) where the node writes its output into the
        first of those inputs that is a floating tensor of the output's shape and dtype which no other tensor
        shares (``memory.exclusive``), through its target's ``out=`` overload (the same kernel: the same
        bits); out of place where none is."""
        for name, fn, args, kwargs, simple in self.calls:
            if in_place is not None and name == in_place[0] and self._call_into(name, fn, args, kwargs, env, sym,
                                                                                 in_place[1]):
                continue
            try:
                if simple:
                    a = [env[x.name] if type(x) is Ref else sym[x.name] if type(x) is SymRef else x for x in args]
                    env[name] = fn(*a, **kwargs)
                elif draw is not None and name in self.random:
                    env[name] = call_random(fn, self.random[name], functools.partial(_arguments, args, kwargs, env),
                                            draw)
                else:
                    env[name] = fn(*_resolve(args, env, sym), **_resolve(kwargs, env, sym))
            except Exception as exc:
                exc.add_note(f"in fx node {name} = {fn}(...) with inputs {_describe_inputs(args, env)}")
                raise


    def _call_into(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict, sym: dict,
                   victims: tuple[str, ...]) -> bool:
        variant = self.out_variant(name, fn)
        if variant is None:
            return False
        a, kw = _arguments(args, kwargs, env, sym)
        tensors = [x for x in a if isinstance(x, torch.Tensor)]
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return False
        for v in victims:
            t = env.get(v)
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == shape and t.is_contiguous()
                    and all(x.dtype == t.dtype or x.dim() == 0 for x in tensors) and exclusive(t)):
                continue
            try:
                env[name] = variant(*a, **kw, out=t)
            except RuntimeError:
                continue
            return True
        return False


def _local_args(args: tuple, node: str, local: Local) -> tuple:
    """``args`` of fx node ``node`` with the size arguments ``local`` names wrapped in ``LocalSize``."""
    out = list(args)
    for name, arg, index in local.size_args:
        if name == node:
            out[arg] = LocalSize(out[arg], index, local.share, local.extent, node)
    return tuple(out)


# ---------------------------------------------------------------------------- calls made otherwise than traced
def as_strided_own(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.as_strided`` of ``x`` on a storage of its own (see ``_runtime_targets``)."""
    return torch.ops.aten.as_strided.default(_own_storage(x), *args, **kwargs)


def as_strided_scatter_own(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.as_strided_scatter`` into ``x`` on a storage of its own (see ``_runtime_targets``)."""
    return torch.ops.aten.as_strided_scatter.default(_own_storage(x), *args, **kwargs)


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    return x if x.storage_offset() == 0 else x.clone()
