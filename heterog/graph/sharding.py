"""Split options of every op of a captured training graph: the ways to divide one dimension of an op's
iteration space among devices in integer (uneven) shares, and what each needs of its inputs and gives on
its outputs (FlexFlow's SOAP, Megatron's tensor parallelism, FastT's channel splits), as plain data.

An op of the OpGraph is a fused op: ``Op.fx_nodes`` runs a main node and the zero-cost views fused after
it (``heterog.graph.fusion``). Its options compose the main node's rules (``heterog.graph.split_rules``:
DTensor's where they hold for uneven shards, else written there) with the views: a placement is carried
through each view, and a rule whose placement no view can carry (a device cannot take its view of a shard
without the whole tensor) is dropped, since that would need a redistribution inside the op.

Placements (``heterog.placement``; a ``SplitOption`` stores their text form, as graphs on disk do): ``"R"``
every device holds the whole tensor, ``"P"`` the tensor is the sum of the devices' tensors, ``"S<d>"``
dimension d is split into shards, ``"S<d>:<f>"`` dimension d is read as f outer blocks each split alike
(heads inside a ``(batch * heads)`` dimension: ``"S0:<batch>"``), ``"-"`` no tensor.
A divided option has an ``extent``: the number of indivisible units shared out. Shares are integers
summing to the extent (uneven allowed); a device with share s holds ``size * s // extent`` of each
split dimension (``size`` the global size; a dimension may hold several elements per unit: divided over
heads, a ``(B, S, heads * head_dim)`` tensor gives head_dim elements of dim 2 per unit), i.e. the
fraction s/extent of every divided tensor's bytes. Options whose inputs and outputs are only R and P
(``kind="partial"``: a linear op passing partial sums on) have no extent and run on every device.

Kinds: ``"batch"`` divides the batch dimension of some tensor (the project's data parallelism),
``"parameter"`` divides a parameter, its gradient, optimizer state or a module buffer (a Linear's or
matmul's features, convolution channels, embedding rows or columns), ``"attribute"`` divides anything
else (sequence, spatial, the heads or features of an op without parameters, e.g. the activation after a
column-split Linear), ``"partial"`` as above.

Shape arguments: ``SplitOption.size_args`` lists the arguments of the op's fx nodes that hold the size
of a split dimension (view, expand, new_zeros, slice_backward sizes, convolution ``groups``,
embedding ``num_weights``); a device passes ``value * share // extent`` there (-1 stays -1).
``transform`` names a local computation other than the node's own call (``"embedding_rows"``: indices
shifted by the device's first row, rows outside its share give zeros; ``"partial_mean"``: a mean over a
split dimension scaled by share/extent, a partial sum). ``heterog.graph.shard_exec`` runs an op on
one device's shard this way; a shard must keep the traced memory order of its dimensions (``dense_like``),
since the fx graph's views assume the traced strides.

One option divides one dimension over one group of devices. Sizes, extents and split factors are those
at the graph's batch size: combined with a batch split on top, a split factor that counts batch rows
(``"S0:<batch>"``) and the sizes of batch-carrying dimensions are the replica's.

Cost: rules are cached by (target, concrete arguments, output shapes) across calls; for bert_large at
full size (batch 48, 2197 ops) the options take about 0.35 s against about 6 s of capture.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from heterog.graph.fusion import VIEW_OPS
from heterog.graph.opgraph import OpGraph
from heterog.graph.split_rules import NodeRule, TensorInfo, node_rules
from heterog.graph.split_views import propagate_view
from heterog.graph.tracing import CapturedStep, Sizes, tensor_leaves
from heterog.placement import P, Placement, R, Shard, parse, text

KINDS = ("batch", "parameter", "attribute", "partial")
RESIDENT_KINDS = ("param", "state", "buffer")      # op kinds whose tensors live with a module


@dataclass(frozen=True)
class InputRef:
    """A tensor an op reads: fx node ``node`` (element ``index`` of a multi-output node read through
    getitem, else None), made by op ``src`` as its output ``src_output`` or a view of it (the OpGraph edge
    ``src -> this op`` with that ``src_output``)."""

    node: str
    index: int | None
    src: int
    src_output: int


@dataclass(frozen=True)
class ExitRef:
    """A tensor an op gives to other ops (or to the step's outputs): fx node ``node`` of its group
    (element ``index`` of a multi-output node, else None), the op's output ``output`` or a view of it.
    A consumer's InputRef with the same node and index reads it."""

    node: str
    index: int | None
    output: int


@dataclass(frozen=True)
class SizeArg:
    """Argument ``arg`` (element ``index`` of a list argument, None for a scalar) of fx node ``node``:
    a size of a split dimension, passed as ``value * share // extent``."""

    node: str
    arg: int
    index: int | None


@dataclass(frozen=True)
class SplitOption:
    """One way to run an op divided among devices (see the module docstring for placements and kinds).

    ``split``: the first output's placement if it is not R (e.g. "S1", "P"), else the first input's that
    is not R. ``inputs``/``exits``/``outputs``: placement per ``OpSplits.inputs``, per ``OpSplits.exits``
    and per output of the op (``Op.output_shapes``). ``source``: "dtensor", "dtensor-pointwise", "hand",
    "view" (a view op alone) or "layout" (a graph input: the layouts it can be stored in).
    """

    kind: str
    split: str
    extent: int | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    exits: tuple[str, ...]
    size_args: tuple[SizeArg, ...] = ()
    transform: str | None = None
    transform_node: str | None = None
    source: str = "dtensor"

    def to_dict(self) -> dict:
        """Plain data; size arguments as [node, arg, index]; the last four fields only where they differ
        from their defaults."""
        d: dict[str, Any] = {"kind": self.kind, "split": self.split, "extent": self.extent,
                             "inputs": list(self.inputs), "outputs": list(self.outputs), "exits": list(self.exits)}
        if self.size_args:
            d["size_args"] = [[a.node, a.arg, a.index] for a in self.size_args]
        if self.transform is not None:
            d["transform"], d["transform_node"] = self.transform, self.transform_node
        if self.source != "dtensor":
            d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SplitOption:
        return cls(kind=d["kind"], split=d["split"], extent=d["extent"], inputs=tuple(d["inputs"]),
                   outputs=tuple(d["outputs"]), exits=tuple(d["exits"]),
                   size_args=tuple(SizeArg(n, int(a), i) for n, a, i in d.get("size_args", ())),
                   transform=d.get("transform"), transform_node=d.get("transform_node"),
                   source=d.get("source", "dtensor"))


@dataclass(frozen=True)
class OpSplits:
    """The split options of one op, with the tensors its placements refer to. ``source``: where the main
    node's rules come from ("dtensor", "dtensor-pointwise", "hand", "dtensor+hand", "view", "layout",
    "none"; "random" for ops that draw random values, which get no option: their draws follow the batch
    samples, ``heterog.runtime.rng``)."""

    target: str
    inputs: tuple[InputRef, ...]
    exits: tuple[ExitRef, ...]
    options: tuple[SplitOption, ...]
    source: str

    def to_dict(self) -> dict:
        return {"target": self.target, "source": self.source,
                "inputs": [[r.node, r.index, r.src, r.src_output] for r in self.inputs],
                "exits": [[r.node, r.index, r.output] for r in self.exits],
                "options": [o.to_dict() for o in self.options]}

    @classmethod
    def from_dict(cls, d: dict) -> OpSplits:
        return cls(target=d["target"], source=d["source"],
                   inputs=tuple(InputRef(n, i, int(s), int(k)) for n, i, s, k in d["inputs"]),
                   exits=tuple(ExitRef(n, i, int(k)) for n, i, k in d["exits"]),
                   options=tuple(SplitOption.from_dict(o) for o in d["options"]))


def splits_to_json(splits: Sequence[OpSplits]) -> list[dict]:
    """JSON-ready form of ``split_options``' result (ints, strings, lists, None)."""
    return [s.to_dict() for s in splits]


def splits_from_json(data: Sequence[dict]) -> list[OpSplits]:
    return [OpSplits.from_dict(d) for d in data]


# ---------------------------------------------------------------------------- the graph's fx view
Key = tuple[str, int | None]    # (fx node, element of a multi-output node or None)


class _Fx:
    """What the options read of the captured fx graph: concrete tensor infos, the op and output each
    fx value belongs to, batch dimensions."""

    def __init__(self, captured: CapturedStep, graph: OpGraph) -> None:
        self.captured = captured
        self.graph = graph
        self.sizes = Sizes(captured.batch_symbols, captured.batch_size)
        self.batch_size = captured.batch_size
        self.op_of: dict[str, int] = {}
        for i, op in enumerate(graph.ops):
            for name in op.fx_nodes or [op.name]:
                self.op_of[name] = i
        self.shape_nodes = frozenset(captured.shape_nodes)
        self._info: dict[str, Any] = {}
        self._args: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._batch_dim: dict[Key, int | None] = {}
        self.origin: dict[Key, int] = {}           # fx value -> output of its op it is (a view of)
        for op in graph.ops:
            self._origins(op.fx_nodes or [op.name])

    def _origins(self, group: list[str]) -> None:
        main = self.captured.node(group[0])
        leaves = tensor_leaves(main.meta.get("val") if main.op != "get_attr" else self._attr(main))
        if isinstance(main.meta.get("val"), (tuple, list)):
            for k, (idx, _) in enumerate(leaves):
                self.origin[(main.name, idx)] = k
        else:
            self.origin[(main.name, None)] = 0
        for name in group[1:]:
            node = self.captured.node(name)
            src = self.view_source(node)
            k = self.origin.get(src, 0) if src is not None else 0
            if isinstance(node.meta.get("val"), (tuple, list)):
                for idx, _ in tensor_leaves(node.meta["val"]):
                    self.origin[(name, idx)] = k
            else:
                self.origin[(name, None)] = k

    def _attr(self, node: Node) -> Any:
        return getattr(self.captured.gm, str(node.target), None)

    def view_source(self, node: Node) -> Key | None:
        """The one tensor a view (or getitem) reads."""
        if node.target is operator.getitem:
            src, index = node.args[0], node.args[1]
            return (src.name, int(index)) if isinstance(src, Node) and isinstance(index, int) else None
        for a in node.all_input_nodes:
            if a.name not in self.shape_nodes and self.info(a) is not None:
                return (a.name, None)
        return None

    def info(self, node: Node) -> Any:
        """TensorInfo of a tensor value, a tuple of TensorInfo/None for a multi-output value, else None."""
        if node.name not in self._info:
            val = node.meta.get("val") if node.op != "get_attr" else self._attr(node)
            if isinstance(val, torch.Tensor):
                self._info[node.name] = TensorInfo(tuple(self.sizes.shape(val)), val.dtype)
            elif isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
                self._info[node.name] = tuple(TensorInfo(tuple(self.sizes.shape(v)), v.dtype)
                                              if isinstance(v, torch.Tensor) else None for v in val)
            else:
                self._info[node.name] = None
        return self._info[node.name]

    def key_info(self, key: Key) -> TensorInfo | None:
        info = self.info(self.captured.node(key[0]))
        return info[key[1]] if key[1] is not None and isinstance(info, tuple) else info

    def batch_dim(self, key: Key) -> int | None:
        if key not in self._batch_dim:
            val = self.captured.node(key[0]).meta.get("val")
            if key[1] is not None and isinstance(val, (tuple, list)):
                val = val[key[1]]
            self._batch_dim[key] = self.sizes.batch_dim(val) if isinstance(val, torch.Tensor) else None
        return self._batch_dim[key]

    def args(self, node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A node's arguments made concrete (``concrete``), computed once."""
        if node.name not in self._args:
            self._args[node.name] = (self.concrete(tuple(node.args)),
                                     {k: self.concrete(v) for k, v in node.kwargs.items()})
        return self._args[node.name]

    def concrete(self, x: Any) -> Any:
        """Node arguments with TensorInfo for tensors and ints for symbolic sizes."""
        if isinstance(x, Node):
            info = self.info(x)
            if info is not None:
                return info
            val = x.meta.get("val")
            return self.sizes.value(val) if val is not None else x
        if isinstance(x, (list, tuple)):
            return type(x)(self.concrete(a) for a in x)
        return self.sizes.value(x)


# ---------------------------------------------------------------------------- options of one op
@dataclass
class _Group:
    """An op's fx nodes and the tensors it reads and gives."""

    main: Node
    views: list[Node]
    inputs: list[InputRef]
    input_keys: list[Key]                 # per tensor argument of the main node: the value it reads
    exits: list[ExitRef]
    output_keys: list[Key]                # per output of the op


def _group(fx: _Fx, index: int) -> _Group:
    op = fx.graph.ops[index]
    names = op.fx_nodes or [op.name]
    members = set(names)
    nodes = [fx.captured.node(n) for n in names]
    main = nodes[0]
    inputs: list[InputRef] = []
    input_keys: list[Key] = []
    if main.op == "call_function":
        refs: list[Key] = []
        if main.target is operator.getitem or op.target in VIEW_OPS:
            src = fx.view_source(main)
            refs = [src] if src is not None else []
        else:
            for a in _flat_args(main):
                if isinstance(a, Node) and a.name not in fx.shape_nodes and fx.info(a) is not None:
                    refs.append((a.name, None))
        for key in refs:
            input_keys.append(key)
            if key not in [(r.node, r.index) for r in inputs]:
                inputs.append(InputRef(key[0], key[1], fx.op_of[key[0]], fx.origin.get(key, 0)))
    exits: list[ExitRef] = []
    for node in nodes:
        outside = [u for u in node.users if u.name not in members and u.name not in fx.shape_nodes]
        if not outside:
            continue
        if isinstance(fx.info(node), tuple):
            picked = sorted({u.args[1] for u in outside if u.target is operator.getitem and isinstance(u.args[1], int)})
            exits += [ExitRef(node.name, k, fx.origin.get((node.name, k), 0)) for k in picked]
        elif fx.info(node) is not None:
            exits.append(ExitRef(node.name, None, fx.origin.get((node.name, None), 0)))
    main_info = fx.info(main)
    if isinstance(main_info, tuple):
        output_keys: list[Key] = [(main.name, i) for i, t in enumerate(main_info) if t is not None]
    else:
        output_keys = [(main.name, None)]
    return _Group(main, nodes[1:], inputs, input_keys, exits, output_keys)


def _flat_args(node: Node) -> list[Any]:
    out: list[Any] = []
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


class _Splitter:
    """Computes the options op by op, in graph order, remembering the shard layouts each exit can give
    (a consumer tries its producers' split factors: heads inside (batch * heads))."""

    def __init__(self, fx: _Fx) -> None:
        self.fx = fx
        self.layouts: dict[Key, set[Shard]] = {}

    # -------------------------------------------------------------- main node rules
    def main_rules(self, op_index: int, g: _Group) -> tuple[list[NodeRule], str]:
        fx = self.fx
        op = fx.graph.ops[op_index]
        main = g.main
        if op.kind != "compute":
            info = fx.info(main)
            if not isinstance(info, TensorInfo):
                return [], "layout"
            rules = [NodeRule((Shard(d),), (), "layout") for d in range(info.ndim) if info.shape[d] >= 2]
            return rules, "layout"
        if op.draws:
            return [], "random"
        if main.target is operator.getitem or op.target in VIEW_OPS:
            return self._view_main_rules(g), "view"
        args, kwargs = fx.args(main)
        info = fx.info(main)
        return node_rules(main.target, args, kwargs, list(info) if isinstance(info, tuple) else [info])

    def _view_main_rules(self, g: _Group) -> list[NodeRule]:
        """A view op on its own (e.g. the expand that brings a buffer to the batch, or any view of an
        unfused graph): every placement of its input it can carry, the input's producers' split
        factors included."""
        fx = self.fx
        if not g.input_keys:
            return []
        src = fx.key_info(g.input_keys[0])
        if src is None:
            return []
        candidates: list[Placement] = [Shard(d) for d in range(src.ndim) if src.shape[d] >= 2]
        candidates += sorted(s for s in self.layouts.get(g.input_keys[0], ()) if s not in candidates)
        if src.floating:
            candidates.append(P)
        rules = []
        main = g.main
        out = fx.info(main)
        for p in candidates:
            if main.target is operator.getitem:
                rules.append(NodeRule((p,), (p,), "view", fixed_layout=True))
                continue
            args, kwargs = fx.args(main)
            step = propagate_view(main.target, args, kwargs, src, out, p,
                                  src.shape[p.dim] // p.sf if isinstance(p, Shard) else None)
            if step is None or isinstance(step.placement, tuple):
                continue
            rules.append(NodeRule((step.placement,), (p,), "view", extent=step.extent, size_args=step.size_args,
                                  fixed_layout=True))
        return rules

    # -------------------------------------------------------------- composition
    def op_splits(self, op_index: int) -> OpSplits:
        fx = self.fx
        op = fx.graph.ops[op_index]
        g = _group(fx, op_index)
        rules, source = self.main_rules(op_index, g)
        options: dict[Any, SplitOption] = {}
        for rule in rules:
            for sf in self._split_factors(rule, g):
                opt = self._compose(op_index, g, rule, sf)
                if opt is not None:
                    options.setdefault((opt.inputs, opt.outputs, opt.exits, opt.extent, opt.transform), opt)
        splits = OpSplits(target=op.target, inputs=tuple(g.inputs), exits=tuple(g.exits),
                          options=tuple(options.values()), source=source)
        for opt in splits.options:
            for ref, placed in zip(splits.exits, opt.exits):
                p = parse(placed)
                if isinstance(p, Shard):
                    self.layouts.setdefault((ref.node, ref.index), set()).add(p)
        return splits

    def _split_factors(self, rule: NodeRule, g: _Group) -> list[int]:
        """1, and the split factors the producers' exits give on the dimensions this rule divides (all of
        the rule's split dimensions the same size, a multiple of the factor)."""
        factors = {1}
        if rule.fixed_layout:
            return [1]
        infos = self._rule_infos(g)
        sizes = {info.shape[p.dim] for p, info in zip([*rule.outputs, *rule.inputs], infos)
                 if isinstance(p, Shard) and info is not None}
        if len(sizes) != 1:
            return [1]
        size = sizes.pop()
        for p, key in zip(rule.inputs, g.input_keys):
            if isinstance(p, Shard):
                factors |= {s.sf for s in self.layouts.get(key, ()) if s.dim == p.dim
                            and size % s.sf == 0 and size // s.sf >= 2}
        return sorted(factors)

    def _rule_infos(self, g: _Group) -> list[TensorInfo | None]:
        fx = self.fx
        outs = [fx.key_info(k) for k in g.output_keys]
        main_info = fx.info(g.main)
        if isinstance(main_info, tuple):       # rule outputs cover every output slot, None ones included
            outs = list(main_info)
        return [*outs, *(fx.key_info(k) for k in g.input_keys)]

    def _compose(self, op_index: int, g: _Group, rule: NodeRule, sf: int) -> SplitOption | None:
        fx = self.fx
        main_info = fx.info(g.main)
        n_slots = len(main_info) if isinstance(main_info, tuple) else 1
        if len(rule.outputs) != n_slots or len(rule.inputs) != len(g.input_keys):
            return None
        rule_outs = [Shard(p.dim, sf) if isinstance(p, Shard) and sf != 1 else p for p in rule.outputs]
        rule_ins = [Shard(p.dim, sf) if isinstance(p, Shard) and sf != 1 else p for p in rule.inputs]
        infos = self._rule_infos(g)
        extent = rule.extent
        if extent is None:
            sizes = [info.shape[p.dim] // p.sf for p, info in zip([*rule_outs, *rule_ins], infos)
                     if isinstance(p, Shard) and info is not None]
            extent = math.gcd(*sizes) if sizes else None
        for p, info in zip([*rule_outs, *rule_ins], infos):
            if isinstance(p, Shard) and info is not None:
                if extent is None or info.shape[p.dim] % (p.sf * extent):
                    return None
        if extent is not None and extent < 2:
            return None
        # one placement per value read: an input read twice must be read alike
        needed: dict[Key, Placement] = {}
        for key, p in zip(g.input_keys, rule_ins):
            if needed.setdefault(key, p) != p:
                return None
        state: dict[Key, Placement | None] = {}
        if isinstance(main_info, tuple):
            for i, p in enumerate(rule_outs):
                state[(g.main.name, i)] = p
        else:
            state[(g.main.name, None)] = rule_outs[0]
        size_args = [SizeArg(g.main.name, a, i) for a, i in rule.size_args]
        for view in g.views:
            src = fx.view_source(view)
            if src is None or state.get(src) is None:
                return None
            p_in = state[src]
            assert p_in is not None
            if view.target is operator.getitem:
                state[(view.name, None)] = p_in
                continue
            src_info = fx.key_info(src)
            out_info = fx.info(view)
            if src_info is None or out_info is None:
                return None
            args, kwargs = fx.args(view)
            step = propagate_view(view.target, args, kwargs, src_info, out_info, p_in, extent)
            if step is None:
                return None
            extent = step.extent
            size_args += [SizeArg(view.name, a, i) for a, i in step.size_args]
            if isinstance(step.placement, tuple):
                for i, p in enumerate(step.placement):
                    state[(view.name, i)] = p
            else:
                state[(view.name, None)] = step.placement
        exits = [state.get((e.node, e.index)) for e in g.exits]
        if any(p is None for p in exits):
            return None
        outputs = [state.get(k) for k in g.output_keys]
        inputs = [needed[(r.node, r.index)] for r in g.inputs]
        if all(p == R for p in [*inputs, *outputs, *exits] if p is not None):
            return None
        has_shard = any(isinstance(p, Shard) for p in [*inputs, *outputs, *exits])
        kind = self._kind(op_index, g, inputs, outputs, exits) if has_shard else "partial"
        split = next((p for p in (*outputs, *inputs) if p is not None and p != R), R)
        return SplitOption(kind=kind, split=str(split), extent=extent if has_shard else None,
                           inputs=tuple(text(p) for p in inputs), outputs=tuple(text(p) for p in outputs),
                           exits=tuple(text(p) for p in exits),
                           size_args=tuple(size_args) if has_shard else (),
                           transform=rule.transform, transform_node=g.main.name if rule.transform else None,
                           source=rule.source)

    def _kind(self, op_index: int, g: _Group, inputs: Sequence[Placement | None],
              outputs: Sequence[Placement | None], exits: Sequence[Placement | None]) -> str:
        fx = self.fx
        op = fx.graph.ops[op_index]
        placed: list[tuple[Key, Placement | None]] = [
            *(((r.node, r.index), p) for r, p in zip(g.inputs, inputs)),
            *zip(g.output_keys, outputs), *(((e.node, e.index), p) for e, p in zip(g.exits, exits))]
        for key, p in placed:
            # the batch dim divided: whole (sf 1), or the samples inside each outer block (sample-minor rows
            # (T * B): blocks that do not count whole batches)
            if isinstance(p, Shard) and fx.batch_dim(key) == p.dim and (p.sf == 1 or p.sf % fx.batch_size):
                return "batch"
        resident_in = any(isinstance(p, Shard) and fx.graph.ops[r.src].kind in RESIDENT_KINDS
                          for r, p in zip(g.inputs, inputs))
        resident_out = (op.kind in RESIDENT_KINDS or op.is_grad) and any(
            isinstance(p, Shard) for p in [*outputs, *exits])
        return "parameter" if resident_in or resident_out else "attribute"


# ---------------------------------------------------------------------------- entry points
def split_options(captured: CapturedStep, graph: OpGraph) -> list[OpSplits]:
    """The split options of every op of ``graph`` (one OpSplits per op, in op order), from the fx graph of
    ``captured`` (the step ``graph`` was built from with ``graph_from_step``, fused or not).

    Placeholder ops (params, buffers, state, inputs) list the layouts they can be stored in
    (``source="layout"``: each dimension divided, with the placements their fused views then give);
    compute ops list their splits (module docstring); ops drawing random values list none.
    """
    fx = _Fx(captured, graph)
    splitter = _Splitter(fx)
    return [splitter.op_splits(i) for i in range(graph.n_ops)]


def rule_sources(graph: OpGraph, splits: Sequence[OpSplits]) -> dict[str, str]:
    """Target -> where its rules come from, over the compute ops of ``graph``."""
    return {op.target: s.source for op, s in zip(graph.ops, splits) if op.kind == "compute"}


def coverage(graph: OpGraph, splits: Sequence[OpSplits], kinds: Sequence[str] = ("parameter", "attribute")
             ) -> float:
    """Fraction of compute ops with at least one option of ``kinds`` (default: beyond the batch)."""
    compute = [s for op, s in zip(graph.ops, splits) if op.kind == "compute"]
    if not compute:
        return 0.0
    return sum(any(o.kind in kinds for o in s.options) for s in compute) / len(compute)


__all__ = ["KINDS", "P", "R", "ExitRef", "InputRef", "OpSplits", "SizeArg", "SplitOption", "coverage",
           "rule_sources", "split_options", "splits_from_json", "splits_to_json"]
