"""The captured training step in the form the runtime executes: fx nodes as picklable calls grouped by
OpGraph op, sizes evaluated at any local batch, op kernels, and the whole step run node by node.

A ``StepProgram`` is built once in the planning process from a symbolic-mode ``CapturedStep`` and its
(fused) OpGraph; it holds no fx or sympy objects, so it travels to worker processes by pickling.

Terms used across the runtime:
  - *leaf* ``(op, k)``: output ``k`` of an OpGraph op, i.e. the ``k``-th tensor of the op's main fx node
    (the node itself when it returns a tensor, else the ``getitem`` node that picks it). Edges of the
    OpGraph carry leaves (``Edge.src_output``); transfers, re-layouts and aggregation move leaves.
  - *chain*: the view nodes fused into the producer between a leaf and the node a consumer reads
    (``t``, ``view``, ``detach``, ...). A consumer that receives a leaf from elsewhere re-runs the chain
    on its own copy, at its own local batch.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from heterog.errors import HeterogError
from heterog.graph.inputs import InputSpec
from heterog.graph.mutations import functional_overload, intermediate_mutations
from heterog.graph.random_ops import draws, inexact_reason
from heterog.runtime.kernel import (
    Kernel,
    LocalSize,
    NodeCall,
    Ref,
    as_strided_own,
    as_strided_scatter_own,
    lower_arg,
    target_name,
)
from heterog.runtime.rng import BatchArg, Draw, RandomNode, block_batches

if TYPE_CHECKING:  # pragma: no cover
    from torch.fx import GraphModule, Node

    from heterog.graph.opgraph import OpGraph
    from heterog.graph.tracing import CapturedStep
    from heterog.runtime.instructions import Local


# ---------------------------------------------------------------------------- leaves and what ops read
@dataclass(frozen=True)
class LeafInfo:
    """Output ``k`` of op ``op``: the fx node holding it, its batch dim and its shape at the global batch."""

    op: int
    k: int
    node: str | None                 # None: the output exists but no node picks it (unused)
    batch_dim: int | None
    shape: tuple[int, ...]           # at the global batch
    dtype: torch.dtype
    per_sample: int = 1              # elements per sample along the batch dim (B*T rows -> T)
    dim_order: tuple[int, ...] | None = None   # memory order of the dims (outermost first) as captured

    @property
    def read_node(self) -> str:
        """``node``, for an output that another op reads (only unused outputs lack a node)."""
        if self.node is None:
            raise AssertionError(f"output {self.k} of op {self.op} is read but no fx node holds it")
        return self.node

    @property
    def memory_order(self) -> tuple[int, ...]:
        """The captured memory order of the dims, outermost first (row-major when nothing was recorded)."""
        return self.dim_order if self.dim_order is not None else tuple(range(len(self.shape)))

    def local_shape(self, samples: int) -> tuple[int, ...]:
        if self.batch_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.batch_dim] = samples * self.per_sample
        return tuple(s)

    @property
    def nbytes_global(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Read:
    """An op reads fx node ``node`` of another op: leaf ``leaf`` followed by view ``chain``. When
    ``tuple_index`` is set, ``node`` is the producer's tuple-valued main node and the reader picks
    element ``tuple_index`` of it (a gradient of a multi-output backward kept as an op of its own)."""

    node: str
    leaf: tuple[int, int]
    chain: tuple[str, ...]
    tuple_index: int | None = None

    def held_node(self, leaf: LeafInfo) -> str:
        """The node whose value the producer's device keeps for this read: ``node``, or for an element of a
        tuple value the element's own node (``leaf``'s), so that the tuple, and every other element of it,
        goes when its last reader in the producer's instruction has run."""
        return self.node if self.tuple_index is None else leaf.read_node


@dataclass
class StepProgram:
    """Everything the runtime needs from a captured step (see the module docstring). Picklable."""

    batch_size: int
    optimizer: str
    lr: float
    param_names: list[str]
    buffer_names: list[str]
    state_names: list[tuple[str, str]]
    n_inputs: int
    placeholders: list[str]
    outputs: list[str]
    calls: dict[str, NodeCall]               # every non-shape call_function node
    order: list[str]                         # those nodes in graph order
    consts: dict[str, torch.Tensor]          # get_attr nodes
    op_nodes: list[list[str]]                # per op: its fx nodes that are calls (placeholders excluded)
    op_kind: list[str]
    op_target: list[str]
    op_has_batch: list[bool]
    leaves: dict[tuple[int, int], LeafInfo]
    reads: list[list[Read]]                  # per op: external nodes it reads
    node_op: dict[str, int]
    node_leaf: dict[str, tuple[int, int]]    # leaf node name -> leaf
    view_calls: dict[str, NodeCall]          # chain nodes (also in calls)
    input_spec: InputSpec | None = None      # how the model is called on the inputs (keywords, batch or not)
    random: dict[str, RandomNode] = field(default_factory=dict)   # nodes that draw random values
    op_phase: list[str] = field(default_factory=list)        # per op: forward | backward | update
    op_coupled: list[bool] = field(default_factory=list)     # per op: couples samples (heterog.graph.coupling)
    coupled_dims: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)   # per node of a coupled op,
                                                             # per tensor of its value: the dims holding the batch
    buffer_updates: list[tuple[int, str]] = field(default_factory=list)   # (buffer index, node of its new value)
    rng_seed: int = 0                        # the run's seed of random draws (``heterog.runtime.rng``)
    _sym_exprs: dict[str, Any] = field(default_factory=dict, repr=False)    # planning side only
    _batch_symbols: tuple = field(default_factory=tuple, repr=False)
    _sym_cache: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _op_kernels: dict[int, Kernel] = field(default_factory=dict, repr=False, compare=False)   # made once a process
    _step_drops: list[list[str]] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_sym_exprs"], d["_batch_symbols"], d["_sym_cache"] = {}, (), {}
        d["_op_kernels"], d["_step_drops"] = {}, None
        return d

    # ------------------------------------------------------------------ sizes
    def sizes_at(self, batch: int) -> dict[str, Any]:
        """Values of all shape nodes when the step runs on ``batch`` samples (planning side)."""
        cached = self._sym_cache.get(batch)
        if cached is not None:
            return cached
        import sympy

        subs = {s: sympy.Integer(int(batch)) for s in self._batch_symbols}
        out: dict[str, Any] = {}
        for name, (kind, expr) in self._sym_exprs.items():
            if kind == "static":
                out[name] = expr
                continue
            v = expr.xreplace(subs)
            if not v.is_number:
                raise HeterogError(f"size node {name} depends on tensor values ({expr}); the runtime needs "
                                   "sizes that follow from the batch size alone")
            out[name] = {"int": int, "float": float, "bool": bool}[kind](v)
        self._sym_cache[batch] = out
        return out

    def input_batched(self, i: int) -> bool:
        """Input ``i`` (flat order) carries the batch on dim 0."""
        return self.input_spec is None or self.input_spec.batched[i]

    def batch_of(self, inputs: Sequence[torch.Tensor]) -> int:
        """The number of samples ``inputs`` (flat order) hold."""
        return next(int(x.shape[0]) for i, x in enumerate(inputs) if self.input_batched(i))

    def kernel(self, op: int, device: torch.device | None = None, local: Local | None = None,
               stats_scale: float | None = None) -> Kernel:
        """Op ``op``'s nodes; ``stats_scale``: its batch-norm node reading the whole batch's sums
        (``heterog.runtime.sync_stats``) at that gradient convention."""
        calls = [self.calls[n] for n in self.op_nodes[op]]
        if stats_scale is not None:
            from heterog.runtime.batch_stats import synced_call

            calls[0] = synced_call(calls[0], stats_scale)
        return Kernel(calls, device, self.random, local)

    def op_draws(self, op: int) -> bool:
        """Op ``op`` has a random node (its instances need a ``Draw``)."""
        return any(n in self.random for n in self.op_nodes[op])

    def inexact_random_ops(self) -> list[str]:
        """One line per random node whose values a replica cannot draw as single-device training does."""
        out = []
        for name in self.random:
            reason = inexact_reason(self.calls[name].target)
            if reason is not None:
                out.append(f"{name} ({self.calls[name].target.removeprefix('op:')}): {reason}")
        return out

    def draw(self, step: int, batch: int, samples: Sequence[int]) -> Draw:
        """The draw of training step ``step`` for an instance holding ``samples`` of ``batch`` samples."""
        return Draw(self.rng_seed, step, batch, samples, {n: self.sizes_at(n) for n in block_batches(batch)})

    # ------------------------------------------------------------------ whole step
    def op_kernel(self, op: int) -> Kernel:
        """Op ``op``'s nodes as one kernel for a run of the whole step on this process (made once)."""
        kernel = self._op_kernels.get(op)
        if kernel is None:
            kernel = self._op_kernels[op] = Kernel([self.calls[n] for n in self.op_nodes[op]], random=self.random)
        return kernel

    def last_readers(self, keep: Iterable[str] = ()) -> list[list[str]]:
        """Per op: the nodes whose last reader it is (or their producer, for nodes no other op reads), which a
        run op by op can drop once it has run; never the placeholders, the constants or ``keep``."""
        last: dict[str, int] = {}
        for op, nodes in enumerate(self.op_nodes):
            for n in nodes:
                last[n] = op
                for ref in _refs((self.calls[n].args, self.calls[n].kwargs)):
                    last[ref] = op
        kept = set(self.placeholders) | set(self.consts) | set(keep)
        out: list[list[str]] = [[] for _ in self.op_nodes]
        for n, op in last.items():
            if n not in kept:
                out[op].append(n)
        return out

    def step(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], state: Sequence[torch.Tensor],
             inputs: Sequence[torch.Tensor], *, step: int = 0
             ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One whole training step (number ``step``), single process: (loss, new params, new state); the new
        values of the buffers the step writes go into ``buffers`` (a list). The ops run in order, each value
        dropped after its last reader: the step holds what training holds, not every value it made."""
        batch = self.batch_of(inputs)
        env: dict[str, Any] = dict(zip(self.placeholders, [*params, *buffers, *state, *inputs]))
        env.update(self.consts)
        sym = self.sizes_at(batch)
        draw = self.draw(step, batch, range(batch)) if self.random else None
        if self._step_drops is None:
            self._step_drops = self.last_readers(keep=[*self.outputs, *(n for _, n in self.buffer_updates)])
        for op, dying in enumerate(self._step_drops):
            if self.op_nodes[op]:
                self.op_kernel(op)(env, sym, draw)
            for n in dying:
                env.pop(n, None)
        out = [env[n] for n in self.outputs]
        p, n_state = len(self.param_names), len(self.state_names)
        if isinstance(buffers, list):
            for i, node in self.buffer_updates:
                buffers[i] = env[node]
        return out[0], out[1:1 + p], out[1 + p:1 + p + n_state]

    def new_values(self) -> list[tuple[str, str]]:
        """(placeholder, the step output that is its next value) of every parameter, state tensor and written
        buffer."""
        n_p, n_b, n_s = len(self.param_names), len(self.buffer_names), len(self.state_names)
        return [*zip(self.placeholders[:n_p], self.outputs[1:1 + n_p]),
                *zip(self.placeholders[n_p + n_b:n_p + n_b + n_s], self.outputs[1 + n_p:1 + n_p + n_s]),
                *[(self.placeholders[n_p + i], node) for i, node in self.buffer_updates]]


def _size_hint(s: Any) -> int:
    """A concrete size or stride from a captured (possibly symbolic) one, at the capture's batch."""
    if isinstance(s, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint
        except ImportError:                  # torch before 2.12: the hint lives on the node
            return int(s.node.hint)
        return int(optimization_hint(s))
    return int(s)


def captured_dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of the captured tensor ``t`` from outermost to innermost in memory (by stride, size-1 dims
    where row-major order puts them). Values that reach a rank by a re-layout, a message or an aggregation
    are re-laid out in this order, so that the captured program's views (``aten.view`` after a permute or
    transpose) see the strides they were traced with."""
    shape = [_size_hint(x) for x in t.shape]
    stride = [_size_hint(x) for x in t.stride()]
    big = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: (-stride[d], d))
    order, it = [], iter(big)
    for d in range(len(shape)):          # size-1 dims keep their place; the others follow the strides
        order.append(d if shape[d] == 1 else next(it))
    return tuple(order)


def _tensor_leaves(val: Any) -> list[tuple[int, Any]]:
    if isinstance(val, torch.Tensor):
        return [(0, val)]
    if isinstance(val, (tuple, list)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def build_step_program(step: CapturedStep, graph: OpGraph) -> StepProgram:
    """The StepProgram of a symbolic-mode CapturedStep and the OpGraph built from it."""
    if step.tracing_mode != "symbolic":
        raise HeterogError("the runtime needs a step traced with tracing_mode='symbolic' (it runs at any "
                           "per-device batch)")
    gm = step.gm
    shape_nodes = frozenset(step.shape_nodes)
    nodes = {n.name: n for n in gm.graph.nodes}
    out_of_place = {**_runtime_targets(gm), **_out_of_place_targets(gm)}
    calls: dict[str, NodeCall] = {}
    order: list[str] = []
    consts: dict[str, torch.Tensor] = {}
    sym_exprs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.name in shape_nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt):
                sym_exprs[n.name] = ("int", v.node.expr)
            elif isinstance(v, torch.SymFloat):
                sym_exprs[n.name] = ("float", v.node.expr)
            elif isinstance(v, torch.SymBool):
                sym_exprs[n.name] = ("bool", v.node.expr)
            else:
                sym_exprs[n.name] = ("static", v)
        elif n.op == "call_function":
            calls[n.name] = NodeCall(n.name, target_name(out_of_place.get(n, n.target)),
                                     lower_arg(tuple(n.args), shape_nodes),
                                     lower_arg(dict(n.kwargs), shape_nodes))
            order.append(n.name)
        elif n.op == "get_attr":
            consts[n.name] = getattr(gm, n.target).detach().clone()

    node_op: dict[str, int] = {}
    op_nodes: list[list[str]] = []
    for i, op in enumerate(graph.ops):
        mine = [name for name in op.fx_nodes if name in calls]
        op_nodes.append(mine)
        for name in op.fx_nodes:
            node_op[name] = i
    missing = [name for name in order if name not in node_op]
    if missing:
        raise HeterogError(f"fx nodes {missing[:5]} belong to no op of graph {graph.name!r}; the graph does not "
                           "come from this captured step")

    # leaves: (op, k) -> node holding the k-th tensor of the op's main node
    leaves: dict[tuple[int, int], LeafInfo] = {}
    node_leaf: dict[str, tuple[int, int]] = {}
    leaf_at_index: dict[tuple[int, int], int] = {}      # (op, index in the main node's tuple) -> k
    for i, op in enumerate(graph.ops):
        main = nodes[op.fx_nodes[0]]
        val = main.meta.get("val")
        if main.op == "get_attr" and val is None:
            val = getattr(gm, main.target)
        tl = _tensor_leaves(val)
        pick: dict[int, str] = {}
        if isinstance(val, torch.Tensor):
            pick[0] = main.name
        else:
            for name in op.fx_nodes[1:]:
                n = nodes[name]
                if n.target is operator.getitem and n.args[0] is main:
                    pick.setdefault(int(n.args[1]), name)
        for k, (idx, t) in enumerate(tl):
            bd = op.batch_dims[k] if k < len(op.batch_dims) else None
            shape = tuple(int(s) for s in op.output_shapes[k])
            per = 1
            if bd is not None:
                if shape[bd] % graph.batch_size:
                    raise HeterogError(f"op {op.name}: output {k} has {shape[bd]} entries along its batch dim, "
                                       f"not a multiple of the batch {graph.batch_size}; cannot split it")
                per = shape[bd] // graph.batch_size
            node = pick.get(idx)
            if node is None and not isinstance(val, torch.Tensor) and main.name in calls:
                # no getitem picks this output (a separate op reads it from the tuple): pick it here so
                # that it can be sent and aggregated like any other leaf
                node = f"{main.name}@{idx}"
                calls[node] = NodeCall(node, target_name(operator.getitem), (Ref(main.name), idx), {})
                op_nodes[i].append(node)
                node_op[node] = i
            dims = captured_dim_order(t)
            leaf = LeafInfo(i, k, node, bd, shape, t.dtype, per, None if dims == tuple(range(len(dims))) else dims)
            leaf_at_index[(i, idx)] = k
            leaves[(i, k)] = leaf
            if leaf.node is not None:
                node_leaf[leaf.node] = (i, k)

    # what each op reads from other ops: leaf + view chain
    reads: list[list[Read]] = []
    view_calls: dict[str, NodeCall] = {}
    for i, op in enumerate(graph.ops):
        own = set(op.fx_nodes)
        seen: dict[str, Read] = {}
        for name in op_nodes[i]:
            if name not in nodes:
                continue          # a pick added above; it reads the op's own main node
            for inp in nodes[name].all_input_nodes:
                if inp.name in own or inp.name in shape_nodes or inp.name in seen:
                    continue
                seen[inp.name] = _read_of(inp, nodes[name], node_op, node_leaf, leaf_at_index, shape_nodes,
                                          calls, view_calls)
        reads.append(list(seen.values()))
    # sanity: every read matches an edge of the graph (the compiler's decisions apply to it)
    edge_set = {(e.src, e.src_output, e.dst) for e in graph.edges}
    for i, rs in enumerate(reads):
        for r in rs:
            if (r.leaf[0], r.leaf[1], i) not in edge_set:
                raise HeterogError(f"op {graph.ops[i].name} reads {r.node} (output {r.leaf[1]} of "
                                   f"{graph.ops[r.leaf[0]].name}) but the graph has no such edge")

    prog = StepProgram(
        batch_size=graph.batch_size, optimizer=step.optimizer, lr=step.lr, param_names=list(step.param_names),
        buffer_names=list(step.buffer_names), state_names=list(step.state_names), n_inputs=step.n_inputs,
        placeholders=list(step.placeholders), outputs=list(step.outputs), calls=calls, order=order, consts=consts,
        op_nodes=op_nodes, op_kind=[op.kind for op in graph.ops], op_target=[op.target for op in graph.ops],
        op_has_batch=[bool(x) for x in graph.has_batch], leaves=leaves, reads=reads, node_op=node_op,
        node_leaf=node_leaf, view_calls=view_calls, input_spec=step.input_spec,
        random=_random_nodes(gm, step.batch_symbols, graph.batch_size, out_of_place),
        op_phase=[op.phase for op in graph.ops], op_coupled=[op.coupled for op in graph.ops],
        coupled_dims=_coupled_dims(graph, nodes, step.batch_symbols),
        buffer_updates=[(step.buffer_names.index(b), node) for b, node in step.buffer_outputs.items()])
    prog._sym_exprs = sym_exprs
    prog._batch_symbols = tuple(step.batch_symbols)
    return prog


def _coupled_dims(graph: OpGraph, nodes: dict[str, Node], batch_symbols: Sequence[Any]
                  ) -> dict[str, list[tuple[int, ...]]]:
    """Per fx node of a coupled op, per tensor of its value, the dims whose size holds the batch."""
    symbols = frozenset(batch_symbols)
    out: dict[str, list[tuple[int, ...]]] = {}
    for op in graph.ops:
        if not op.coupled:
            continue
        for name in op.fx_nodes:
            val = nodes[name].meta.get("val") if name in nodes else None
            values = list(val) if isinstance(val, (tuple, list)) else [val]
            out[name] = [tuple(d for d, size in enumerate(v.shape) if isinstance(size, torch.SymInt)
                               and size.node.expr.free_symbols & symbols) if isinstance(v, torch.Tensor) else ()
                         for v in values]
    return out


def _random_nodes(gm: GraphModule, batch_symbols: Sequence[Any], batch_size: int, out_of_place: dict[Node, Any]
                  ) -> dict[str, RandomNode]:
    """The nodes that draw random values, with where their arguments and outputs carry the batch."""
    symbols = frozenset(batch_symbols)
    subs = {s: batch_size for s in symbols}

    def batch_at(index: int | str, t: Any) -> BatchArg | None:
        if not isinstance(t, torch.Tensor):
            return None
        for d, size in enumerate(t.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & symbols:
                return BatchArg(index, d, int(size.node.expr.xreplace(subs)) // batch_size)
        return None

    out: dict[str, RandomNode] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not draws(out_of_place.get(n, n.target), n.args, n.kwargs):
            continue
        args = [batch_at(i, a.meta.get("val")) for i, a in [*enumerate(n.args), *n.kwargs.items()]
                if hasattr(a, "meta")]
        val = n.meta.get("val")
        values = list(val) if isinstance(val, (tuple, list)) else [val]
        outs = [batch_at(i, v) for i, v in enumerate(values)]
        orders = []
        for v in values:
            order = captured_dim_order(v) if isinstance(v, torch.Tensor) else None
            orders.append(None if order is None or order == tuple(range(len(order))) else order)
        out[n.name] = RandomNode(n.name, tuple(a for a in args if a is not None),
                                 tuple(o for o in outs if o is not None), tuple(orders))
    return out


def _runtime_targets(gm: GraphModule) -> dict[Node, Any]:
    """Calls the runtime makes differently from the trace, with the same values:

    - ``aten.view`` -> ``aten.reshape``: a view where the strides allow one (the same tensor, so writes
      through it behave as traced), a copy where they do not. A traced view needs the strides the fake
      tensors had; a real kernel may lay its output out otherwise (a backward kernel given inputs of
      different layouts: Swin's dropout backward), and a value re-laid out between ranks is put in the
      captured order, which then no longer matches what the real kernels after it produce.
    - ``as_strided`` and ``as_strided_scatter`` on a storage of their own: their sizes, strides and offset
      address the storage, which the trace had to itself; a replica's piece of a batch tensor may be a
      slice of a larger storage (a re-layout on one device), where they would address other samples."""
    aten = torch.ops.aten
    replace = {aten.view.default: aten.reshape.default, aten.as_strided.default: as_strided_own,
               aten.as_strided_scatter.default: as_strided_scatter_own}
    return {n: replace[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in replace}


def _out_of_place_targets(gm: GraphModule) -> dict[Node, Any]:
    """In-place ops on intermediate values (``aten.div_`` in the backward of a mean loss) -> their
    out-of-place overloads, where nothing reads the mutated value (or a view of it) after the op.

    The runtime keeps each op's outputs by name and hands the same tensor to several readers (a send, a
    re-layout, a local consumer, the scaling probe), in an order that is the simulated schedule, not the
    traced one: an in-place op there rewrites a value that others still read as the traced program had it
    before (the probe then saw ``mul`` already divided by the batch and gave it the backward exponent -1;
    re-laid out between unequal shares, every gradient came out scaled by the ratio of the shares). The
    out-of-place op computes the same result and leaves its input alone. Mutations of placeholders
    (batch-norm running statistics) are kept as traced; the capture functionalises mutations of
    intermediates that are read again (``heterog.graph.mutations``)."""
    out: dict[Node, Any] = {}
    for n, read_later in intermediate_mutations(gm).items():
        functional = None if read_later else functional_overload(n.target)
        if functional is not None:
            out[n] = functional
    return out


def _read_of(inp: Node, reader: Node, node_op: dict[str, int], node_leaf: dict[str, tuple[int, int]],
             leaf_at_index: dict[tuple[int, int], int], shape_nodes: frozenset[str], calls: dict[str, NodeCall],
             view_calls: dict[str, NodeCall]) -> Read:
    if inp.name not in node_leaf and reader.target is operator.getitem and reader.args[0] is inp:
        index = reader.args[1]
        assert isinstance(index, int)       # an element of a tuple-valued node, picked by position
        k = leaf_at_index.get((node_op[inp.name], index))
        if k is not None:
            return Read(inp.name, (node_op[inp.name], k), (), index)
    chain: list[str] = []
    cur = inp
    while cur.name not in node_leaf:
        ins = [x for x in cur.all_input_nodes if x.name not in shape_nodes]
        if len(ins) != 1 or node_op.get(ins[0].name) != node_op.get(cur.name):
            raise HeterogError(f"fx node {inp.name} is neither an op output nor a view of one")
        chain.append(cur.name)
        view_calls[cur.name] = calls[cur.name]
        cur = ins[0]
    return Read(inp.name, node_leaf[cur.name], tuple(reversed(chain)))


def _refs(a: Any) -> Iterator[str]:
    """The names of the values an fx node's arguments read."""
    if type(a) is Ref:
        yield a.name
    elif isinstance(a, (tuple, list)):
        for x in a:
            yield from _refs(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _refs(x)
    elif type(a) is LocalSize:
        yield from _refs(a.inner)
