"""In-place ops on intermediate values of a traced step: which of them can run out of place, and
functionalising a step whose mutated intermediates are read again.

A graph traced by make_fx keeps the model's in-place ops (``copy_`` into a slice, ``fill_``,
``masked_fill_``). A mutation of an intermediate that is read again afterwards is a data dependency that no
edge shows: Hugging Face's ``shift_tokens_right`` writes the labels into a slice of ``new_zeros`` and then
reads the whole tensor. Op graphs, schedules and replicas built from such a trace read the tensor before
or after the write as their order happens to be. ``functionalize`` re-traces the step so that every such
write is a new value (``slice_scatter``, ``select_scatter``, ...) that its readers depend on.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

ORIGIN_KEY = "heterog_origin"     # node.meta["custom"] entry: the node of the original trace it comes from


def writes_first_arg(target: Any) -> bool:
    """The op writes into its first argument (``add_``, ``copy_``, ``fill_``...)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def is_view(target: Any) -> bool:
    """The op returns a view of its first argument."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def intermediate_mutations(gm: GraphModule) -> dict[Node, bool]:
    """In-place nodes that write into an intermediate value (not a placeholder or constant) -> whether the
    written value, or a view of the same storage, is read after the write."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out: dict[Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not writes_first_arg(n.target) or not n.args:
            continue
        root = n.args[0]
        while getattr(root, "op", None) == "call_function" and is_view(root.target):
            root = root.args[0]
        if getattr(root, "op", None) != "call_function":
            continue                         # a placeholder, constant or non-node: a real state update
        aliases, todo = set(), [root]
        while todo:
            a = todo.pop()
            aliases.add(a)
            todo.extend(u for u in a.users if u.op == "call_function" and is_view(u.target) and u not in aliases)
        out[n] = any(order[u] > order[n] for a in aliases for u in a.users if u is not n and u not in aliases)
    return out


def functional_overload(target: Any) -> Any | None:
    """The out-of-place overload of an in-place ATen op (``aten.div_.Scalar`` -> ``aten.div.Scalar``)."""
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1].rstrip("_"), None)
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    return functional if functional is not None and not writes_first_arg(functional) else None


def functionalize(gm: GraphModule) -> tuple[GraphModule, dict[str, str]]:
    """``gm`` re-traced (symbolic sizes kept) with every mutation of an intermediate turned into a new
    value, and each new node's origin: new node name -> the name of the node of ``gm`` that made it.

    Mutations of placeholders stay writes into them (``copy_`` at the end), as in eager training. Node
    names change; the caller maps what it recorded per node through the origins."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    for n in gm.graph.nodes:
        n.meta.setdefault("custom", {})[ORIGIN_KEY] = n.name
    args = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]

    def replay(*xs: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(gm).run(*xs)

    new = make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="symbolic")(*args)
    origin: dict[str, str] = {}
    for n in new.graph.nodes:
        custom = n.meta.get("custom") or {}
        if ORIGIN_KEY in custom:
            origin[n.name] = custom.pop(ORIGIN_KEY)
    for n in gm.graph.nodes:
        n.meta["custom"].pop(ORIGIN_KEY, None)
    return new, origin


def _root(node: Any) -> Any:
    while getattr(node, "op", None) == "call_function" and is_view(node.target):
        node = node.args[0]
    return node


def placeholder_writes(gm: GraphModule, nodes: list[Node]) -> bool:
    """Whether an op of ``gm`` writes into one of the placeholders ``nodes`` (or a view of one): a buffer the
    model updates in place (a batch norm's running statistics, its count of batches)."""
    return bool(placeholder_writers(gm, nodes))


def placeholder_writers(gm: GraphModule, nodes: list[Node]) -> list[tuple[Node, Node]]:
    """(writer, placeholder) for each op of ``gm`` that writes into one of the placeholders ``nodes`` (or a view
    of one), in graph order."""
    targets = set(nodes)
    out = []
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                if _root(value) in targets:
                    out.append((n, _root(value)))
    return out


def buffer_outputs(gm: GraphModule, buffers: list[Node]) -> dict[int, Node]:
    """The writes of a functionalised step into the placeholders ``buffers`` (``copy_`` of the new value at the
    end, ``functionalize``) removed: buffer index -> the node of its new value, which the caller makes an
    output of the step, so that every device holding the buffer gets it."""
    index = {b: i for i, b in enumerate(buffers)}
    out: dict[int, Node] = {}
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in index:
            out[index[n.args[0]]] = n.args[1]
            n.replace_all_uses_with(n.args[1])
            gm.graph.erase_node(n)
    return dict(sorted(out.items()))
