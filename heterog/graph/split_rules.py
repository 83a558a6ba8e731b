"""Split rules of single ATen nodes (used by ``heterog.graph.sharding``): when one dimension of a node's
iteration space is divided among devices, what the node needs of each tensor argument and gives for each
output; taken from PyTorch DTensor's sharding strategies where they hold for uneven shards, written here
where DTensor has none or its rule needs a local change (``HAND_RULES``). Views are
``heterog.graph.split_views``.

Querying DTensor offline (torch 2.13): the registry is ``DTensor._op_dispatcher.sharding_propagator``.
Single-dim strategies (``op_single_dim_strategy_funcs``, most ops) are plain functions of
``(op, args_meta, kwargs_meta)`` with TensorMeta for tensors and need no mesh at all. Op strategies
(``op_strategy_funcs``: softmax, reductions, losses, ...) read a mesh from their OpStrategy arguments; a
``DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)`` serves, with no process group and no
global state (``dist.init_process_group("fake", store=FakeStore(), ...)`` as torch's own
``strategy_validation`` does works too, but sets the process-wide default group). Strategies that follow
their inputs index the input strategies in parallel, so each query passes one placement per argument: one
argument takes each candidate placement in turn, the others Replicate (``_dtensor_strategy_rules``).
``op_to_rules`` (convolution only, also a single-dim strategy) and the decomposition fallback are not used.

What is kept of a DTensor rule: Replicate, Shard (a ``_ShardingPlaceholder`` or ``Shard``, taken as any
layout of the split dimension, split factors included) and ``Partial("sum")``. Dropped:
``Partial("avg")`` (the plain mean of unequal shards' means is not the mean), ``Partial("max"/"min"/
"product")`` (not a sum), ``_MaskPartial`` (embedding rows, written here with its local index shift),
``_StridedShard``, and partial sums of integer or bool tensors.

Rules written here (``HAND_RULES``: "extend" adds to DTensor's rules, "replace" stands alone):

- convolution, convolution_backward (extend): DTensor divides the batch only; here output channels, input
  channels (partial sums) and groups (``groups`` and ``bias_sizes`` passed as local sizes).
- embedding (extend): rows; ids shifted by the device's first row, zeros outside it (DTensor's
  ``_MaskPartial``), transform ``embedding_rows``. embedding_dense_backward (extend): its rows, not in DTensor.
- mean.dim, mean.default (extend): a reduced dimension divided; the local mean times share/extent is a
  partial sum (DTensor gives ``Partial("avg")``, wrong for unequal shares), transform ``partial_mean``.
- cat, stack (replace): tensor-list arguments; the other dimensions divided alike.
- ones, zeros, full, empty, new_zeros/ones/empty/full (replace): any dimension, the size passed as local.
- avg_pool2d_backward (replace): not in DTensor; batch and channels, as DTensor's avg_pool2d.
- _scaled_dot_product_flash_attention_for_cpu and its backward (replace): DTensor rules only the CUDA
  kernels; batch and heads.
- hardtanh_backward, lift_fresh_copy and other unregistered elementwise ops (``DECLARED_POINTWISE``):
  DTensor's generic pointwise rule.
- arange, scalar_tensor (``POSITIONAL``): no split (values depend on the position).

Every other compute op takes DTensor's rule (or none, where DTensor has none): mm, addmm, bmm, pointwise
ops, softmax and log-softmax, layer and batch norm, reductions, losses, slice/select backward, ...
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from heterog.placement import P, Placement, R, Shard


@dataclass(frozen=True)
class TensorInfo:
    """Concrete shape and dtype of one tensor value (at the graph's batch size)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class NodeRule:
    """One way to run a node on a share of one iteration dimension.

    ``outputs``: placement given per tensor output of the node (None where the node returns no tensor);
    ``inputs``: placement needed per tensor argument (args then kwargs, lists flattened). ``extent``:
    the number of indivisible units shared out (None: the common size of the sharded dimensions, set by
    the caller). ``size_args``: (argument, element or None) of the node holding a size of a sharded
    dimension: a device passes ``value * share // extent``. ``transform``: the local call differs from
    the node's own (``heterog.graph.shard_exec``). ``fixed_layout``: only plain shards (split factor 1).
    """

    outputs: tuple[Placement | None, ...]
    inputs: tuple[Placement, ...]
    source: str
    extent: int | None = None
    size_args: tuple[tuple[int, int | None], ...] = ()
    transform: str | None = None
    fixed_layout: bool = False


# ---------------------------------------------------------------------------- arguments
def tensor_args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[int | str, int | None, Any]]:
    """(argument position or keyword, element within a list argument or None, value) of every value that
    is a TensorInfo, in the order DTensor numbers tensor arguments."""
    out: list[tuple[int | str, int | None, Any]] = []
    keyed: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    for key, a in keyed:
        if isinstance(a, TensorInfo):
            out.append((key, None, a))
        elif isinstance(a, (list, tuple)):
            out.extend((key, j, b) for j, b in enumerate(a) if isinstance(b, TensorInfo))
    return out


# ---------------------------------------------------------------------------- DTensor
class _DTensorRegistry:
    """DTensor's sharding propagator and a 2-device mesh without a process group, made on first use
    (importing ``torch.distributed.tensor`` takes about a second)."""

    def __init__(self) -> None:
        self._prop: Any = None
        self._mesh: Any = None

    def load(self) -> tuple[Any, Any]:
        if self._prop is None:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor

            self._prop = DTensor._op_dispatcher.sharding_propagator
            self._mesh = DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)
        return self._prop, self._mesh


DTENSOR = _DTensorRegistry()


def _meta(info: TensorInfo) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    shape = torch.Size(info.shape)
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(1, shape[i + 1])
    return TensorMeta(shape=shape, stride=tuple(stride), dtype=info.dtype)


def _map_tensors(x: Any, fn: Callable[[TensorInfo], Any]) -> Any:
    if isinstance(x, TensorInfo):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map_tensors(a, fn) for a in x)
    if isinstance(x, list):
        return [_map_tensors(a, fn) for a in x]
    return x


_DROP = object()


def _from_dtensor(p: Any, ndim: int) -> Any:
    """Our placement for a DTensor placement (``_DROP`` for those not kept, see the module docstring)."""
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.placement_types import Partial, Replicate
    from torch.distributed.tensor.placement_types import Shard as DShard

    if p is None:
        return None
    if isinstance(p, _ShardingPlaceholder) or type(p) is DShard:
        return Shard(p.dim % ndim if ndim else 0)
    if isinstance(p, Replicate):
        return R
    if type(p) is Partial and p.reduce_op == "sum":
        return P
    return _DROP


def dtensor_source(target: Any) -> str | None:
    """Which DTensor registry has a rule for ``target``: "single-dim", "strategy" or None."""
    prop, _ = DTENSOR.load()
    if target in prop.op_single_dim_strategy_funcs:
        return "single-dim"
    if target in prop.op_strategy_funcs:
        return "strategy"
    return None


def _dtensor_single_dim_rules(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
                              ins: list[TensorInfo], outs: list[TensorInfo | None],
                              func: Callable[..., Any] | None = None, source: str = "dtensor") -> list[NodeRule]:
    prop, _ = DTENSOR.load()
    if func is None:
        func = prop.op_single_dim_strategy_funcs[target].func
    try:
        rows = func(target, _map_tensors(tuple(args), _meta), _map_tensors(dict(kwargs), _meta))
    except Exception:   # a strategy that cannot take these arguments: no rule from DTensor
        return []
    n_out = len(outs)
    rules = []
    for row in rows:
        if len(row) != n_out + len(ins):
            continue
        infos: list[TensorInfo | None] = [*outs, *ins]
        conv = [_from_dtensor(p, info.ndim if info is not None else 0) for p, info in zip(row, infos)]
        if any(c is _DROP for c in conv):
            continue
        rules.append(NodeRule(outputs=tuple(conv[:n_out]), inputs=tuple(conv[n_out:]), source=source))
    return rules


def _dtensor_strategy_rules(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
                            ins: list[TensorInfo], outs: list[TensorInfo | None]) -> list[NodeRule]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor.placement_types import Partial, Replicate
    from torch.distributed.tensor.placement_types import Shard as DShard

    prop, mesh = DTENSOR.load()
    func = prop.op_strategy_funcs[target]
    if any(isinstance(a, (list, tuple)) and any(isinstance(b, TensorInfo) for b in a) for a in args):
        return []   # tensor lists (cat, stack): written here

    def strategy(info: TensorInfo, placement: Any) -> Any:
        return OpStrategy([OpSpec(DTensorSpec(mesh, (placement,), tensor_meta=_meta(info)))])

    seeds: list[tuple[int, Any]] = [(-1, None)]
    for k, info in enumerate(ins):
        seeds += [(k, DShard(d)) for d in range(info.ndim) if info.shape[d] >= 2]
        if info.floating:
            seeds.append((k, Partial()))
    rules: dict[tuple[Any, ...], NodeRule] = {}
    for seed_k, seed in seeds:
        counter = iter(range(len(ins)))

        def arg(a: Any) -> Any:
            if not isinstance(a, TensorInfo):
                return a
            k = next(counter)
            return strategy(a, seed if k == seed_k else Replicate())

        schema_args = tuple(arg(a) for a in args)
        schema_kwargs = {key: arg(v) for key, v in kwargs.items()}
        try:
            result = func(OpSchema(target, schema_args, schema_kwargs))
        except Exception:   # a strategy that rejects this seed (e.g. even sharding required): no rule from it
            continue
        for spec in getattr(result, "strategies", []):
            out_specs = spec.output_specs
            out_specs = out_specs if isinstance(out_specs, tuple) else (out_specs,) * len(outs)
            if len(out_specs) != len(outs):
                continue
            in_specs = spec.input_specs if spec.input_specs is not None else (spec.output_spec,) * len(ins)
            if len(in_specs) != len(ins):
                continue
            o = [None if s is None or info is None else _from_dtensor(s.placements[0], info.ndim)
                 for s, info in zip(out_specs, outs)]
            i = [_from_dtensor(s.placements[0], info.ndim) for s, info in zip(in_specs, ins)]
            if any(c is _DROP for c in (*o, *i)):
                continue
            rule = NodeRule(outputs=tuple(o), inputs=tuple(i), source="dtensor")
            rules.setdefault((rule.outputs, rule.inputs), rule)
    return list(rules.values())


# ---------------------------------------------------------------------------- written here
aten = torch.ops.aten

HandRule = Callable[[Sequence[Any], dict[str, Any], list[TensorInfo], list[Union[TensorInfo, None]]], list[NodeRule]]


def _conv_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                outs: list[TensorInfo | None]) -> list[NodeRule]:
    """convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    output channels (weight rows, bias), input channels (weight columns; partial sums, the bias taken as
    a partial sum too) and, grouped, whole groups (``groups`` passed as the local count)."""
    transposed, groups = args[6], int(args[8])
    has_bias = len(ins) == 3
    if transposed:
        return []
    if groups == 1:
        c_out, c_in = ins[1].shape[0], ins[1].shape[1]
        rules = [NodeRule((Shard(1),), (R, Shard(0)) + ((Shard(0),) if has_bias else ()), "hand", extent=c_out),
                 NodeRule((P,), (Shard(1), Shard(1)) + ((P,) if has_bias else ()), "hand", extent=c_in)]
        return rules
    return [NodeRule((Shard(1),), (Shard(1), Shard(0)) + ((Shard(0),) if has_bias else ()), "hand",
                     extent=groups, size_args=((8, None),), fixed_layout=True)]


def _conv_backward_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                         outs: list[TensorInfo | None]) -> list[NodeRule]:
    """convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias): the same three splits as
    the forward (``bias_sizes`` and ``groups`` passed as local sizes)."""
    bias_sizes, transposed, groups = list(args[3] or []), args[7], int(args[9])
    if transposed:
        return []

    def masked(ps: tuple[Placement, Placement, Placement]) -> tuple[Placement | None, ...]:
        return tuple(p if o is not None else None for p, o in zip(ps, outs))

    c_out, c_in = ins[2].shape[0], ins[2].shape[1]
    bias_arg: tuple[tuple[int, int | None], ...] = ((3, 0),) if bias_sizes and bias_sizes[0] == c_out else ()
    if groups == 1:
        return [NodeRule(masked((P, Shard(0), Shard(0))), (Shard(1), R, Shard(0)), "hand", extent=c_out,
                         size_args=bias_arg),
                NodeRule(masked((Shard(1), Shard(1), R)), (R, Shard(1), Shard(1)), "hand", extent=c_in)]
    return [NodeRule(masked((Shard(1), Shard(0), Shard(0))), (Shard(1), Shard(1), Shard(0)), "hand",
                     extent=groups, size_args=((9, None),) + bias_arg, fixed_layout=True)]


def _embedding_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                     outs: list[TensorInfo | None]) -> list[NodeRule]:
    """embedding(weight, indices, ...): rows of the table; a device looks up the indices in its rows
    (shifted by its first row) and gives zeros for the others: a partial sum (DTensor's _MaskPartial)."""
    return [NodeRule((P,), (Shard(0), R), "hand", extent=ins[0].shape[0], transform="embedding_rows",
                     fixed_layout=True)]


def _embedding_backward_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                              outs: list[TensorInfo | None]) -> list[NodeRule]:
    """embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq): rows
    of the weight gradient (not in DTensor); each device keeps the gradient of the indices in its rows
    (``num_weights`` passed as the local row count; not with ``scale_grad_by_freq``, whose counts span
    all rows)."""
    if len(args) > 4 and args[4]:
        return []
    return [NodeRule((Shard(0),), (R, R), "hand", extent=int(args[2]), size_args=((2, None),),
                     transform="embedding_rows", fixed_layout=True)]


def _concat_rules(stack: bool) -> HandRule:
    def rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
              outs: list[TensorInfo | None]) -> list[NodeRule]:
        """cat/stack(tensors, dim): any other dimension, every input split alike; partial sums stay
        partial. Legacy empty 1-D inputs of cat (shape (0,)) are skipped by cat itself: Replicate."""
        out = outs[0]
        if out is None:
            return []
        dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.ndim
        skipped = [not stack and t.shape == (0,) and out.ndim != 1 for t in ins]
        rules = []
        for d in range(out.ndim):
            if d == dim or out.shape[d] < 2:
                continue
            d_in = d - 1 if stack and d > dim else d
            rules.append(NodeRule((Shard(d),), tuple(R if s else Shard(d_in) for s in skipped), "hand"))
        if out.floating:
            rules.append(NodeRule((P,), tuple(R if s else P for s in skipped), "hand"))
        return rules
    return rules


def _factory_rules(size_arg: int) -> HandRule:
    def rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
              outs: list[TensorInfo | None]) -> list[NodeRule]:
        """Factories with a size argument (ones, zeros, full, empty, new_zeros, ...): any dimension, the
        size passed as the local one; a tensor argument (new_*: dtype and device only) Replicate."""
        out = outs[0]
        if out is None:
            return []
        return [NodeRule((Shard(d),), (R,) * len(ins), "hand", size_args=((size_arg, d),))
                for d in range(out.ndim) if out.shape[d] >= 2]
    return rules


def _mean_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                outs: list[TensorInfo | None]) -> list[NodeRule]:
    """mean(x, dims): a reduced dimension divided gives partial sums once each device scales its local
    mean by share/extent (DTensor's rule gives Partial("avg"), the plain mean of the devices' means,
    which unequal shares break). This splits decomposed norms (Llama's RMSNorm) over their features."""
    x = ins[0]
    dims = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("dim")
    reduced = range(x.ndim) if not dims else sorted(int(d) % x.ndim for d in dims)
    return [NodeRule((P,), (Shard(d),), "hand", transform="partial_mean") for d in reduced if x.shape[d] >= 2]


def _cpu_attention_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                         outs: list[TensorInfo | None]) -> list[NodeRule]:
    """CPU flash attention, forward ((q, k, v[, mask]) -> (out, logsumexp)) and backward ((grad, q, k,
    v, out, logsumexp[, mask]) -> (dq, dk, dv)): batch and heads, every (B, H, ...) tensor alike, a
    mask's broadcast dimensions whole. DTensor rules only the CUDA kernels."""
    rules = []
    aligned = 6 if len(outs) == 3 else 3          # tensors laid out (B, H, ...); a mask after them
    for d in (0, 1):
        if ins[0].shape[d] < 2:
            continue
        placed: list[Placement] = []
        for i, t in enumerate(ins):
            k = d if i < aligned else d - (ins[0].ndim - t.ndim)
            placed.append(Shard(k) if 0 <= k < t.ndim and t.shape[k] >= 2 else R)
        rules.append(NodeRule(tuple(Shard(d) if o is not None else None for o in outs), tuple(placed), "hand"))
    return rules


def _avg_pool_backward_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                             outs: list[TensorInfo | None]) -> list[NodeRule]:
    """avg_pool2d_backward(grad_output, self, ...): batch and channels, as DTensor's avg_pool2d."""
    return [NodeRule((Shard(d),), (Shard(d), Shard(d)), "hand") for d in (0, 1)
            if ins[1].ndim == 4 and ins[1].shape[d] >= 2]


def _pointwise_rules(args: Sequence[Any], kwargs: dict[str, Any], ins: list[TensorInfo],
                     outs: list[TensorInfo | None], target: Any = None) -> list[NodeRule]:
    """DTensor's generic pointwise rule (``_common_pointwise_single_dim_strategy``), for elementwise ops
    DTensor does not register."""
    from torch.distributed.tensor._ops._pointwise_ops import _common_pointwise_single_dim_strategy

    return _dtensor_single_dim_rules(target, args, kwargs, ins, outs,
                                     func=_common_pointwise_single_dim_strategy(), source="dtensor-pointwise")


# target -> rules written here; "replace" drops DTensor's rules for the target, "extend" adds to them
HAND_RULES: dict[Any, tuple[str, HandRule]] = {
    aten.convolution.default: ("extend", _conv_rules),
    aten.convolution_backward.default: ("extend", _conv_backward_rules),
    aten.embedding.default: ("extend", _embedding_rules),
    aten.embedding_dense_backward.default: ("extend", _embedding_backward_rules),
    aten.cat.default: ("replace", _concat_rules(stack=False)),
    aten.stack.default: ("replace", _concat_rules(stack=True)),
    aten.avg_pool2d_backward.default: ("replace", _avg_pool_backward_rules),
    aten.mean.dim: ("extend", _mean_rules),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("replace", _cpu_attention_rules),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("replace", _cpu_attention_rules),
    aten.mean.default: ("extend", _mean_rules),
    aten.ones.default: ("replace", _factory_rules(0)),
    aten.zeros.default: ("replace", _factory_rules(0)),
    aten.empty.memory_format: ("replace", _factory_rules(0)),
    aten.full.default: ("replace", _factory_rules(0)),
    aten.new_zeros.default: ("replace", _factory_rules(1)),
    aten.new_ones.default: ("replace", _factory_rules(1)),
    aten.new_empty.default: ("replace", _factory_rules(1)),
    aten.new_full.default: ("replace", _factory_rules(1)),
}
# elementwise ops without a DTensor registration, given DTensor's generic pointwise rule
DECLARED_POINTWISE = frozenset({
    aten.hardtanh_backward.default, aten.lift_fresh_copy.default, aten.leaky_relu_backward.default,
    aten.elu_backward.default, aten.hardsigmoid_backward.default, aten.hardswish_backward.default,
})
# DTensor-ruled ops with a size argument (of their output), from DTensor's ``op_to_shape_and_stride_idx``
SIZE_ARG = {
    aten.expand.default: 1, aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
    aten.select_backward.default: 1, aten.slice_backward.default: 1,
}
# ops whose result depends on the position of an element along every dimension: no split
POSITIONAL = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default})
# scans along a dimension (argument 1): a shard of it would scan its own entries only
SCANS = frozenset({aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
                   aten.cummin.default})


_RULES: dict[Any, tuple[list[NodeRule], str]] = {}     # cache: (target, arguments, outputs) -> node_rules


def node_rules(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
               outs: list[TensorInfo | None]) -> tuple[list[NodeRule], str]:
    """The rules of one node whose arguments are concrete (TensorInfo for tensors) and where they come
    from: "dtensor", "dtensor-pointwise", "hand", "dtensor+hand" or "none". Cached by target, arguments
    and output shapes (a transformer's layers share them)."""
    try:
        key: Any = (target, _freeze(args), _freeze(kwargs), tuple(outs))
        hash(key)
    except TypeError:
        return _node_rules(target, args, kwargs, outs)
    if key not in _RULES:
        _RULES[key] = _node_rules(target, args, kwargs, outs)
    return _RULES[key]


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(a) for a in x)
    if isinstance(x, dict):
        return tuple((k, _freeze(v)) for k, v in x.items())
    return x


def _node_rules(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
                outs: list[TensorInfo | None]) -> tuple[list[NodeRule], str]:
    ins = [info for _, _, info in tensor_args(args, kwargs)]
    if target in POSITIONAL:
        return [], "none"
    mode, hand = HAND_RULES.get(target, ("", None))
    rules: list[NodeRule] = []
    source = "none"
    if mode != "replace":
        which = dtensor_source(target)
        if which == "single-dim":
            rules = _dtensor_single_dim_rules(target, args, kwargs, ins, outs)
        elif which == "strategy":
            rules = _dtensor_strategy_rules(target, args, kwargs, ins, outs)
        elif target in DECLARED_POINTWISE:
            rules = _pointwise_rules(args, kwargs, ins, outs, target=target)
        source = "dtensor-pointwise" if target in DECLARED_POINTWISE else ("dtensor" if which else "none")
    if hand is not None:
        rules = rules + hand(args, kwargs, ins, outs)
        source = "dtensor+hand" if mode == "extend" and source != "none" else "hand"
    if target in SIZE_ARG:
        rules = [_with_output_size_arg(r, SIZE_ARG[target]) for r in rules]
    if target in SCANS and ins:
        dim = int(args[1]) % max(ins[0].ndim, 1)
        rules = [r for r in rules if not any(isinstance(p, Shard) and p.dim == dim for p in (*r.inputs, *r.outputs))]
    return [r for r in rules if _valid(r, ins, outs)], source


def _with_output_size_arg(rule: NodeRule, arg: int) -> NodeRule:
    out = rule.outputs[0] if rule.outputs else None
    if not isinstance(out, Shard):
        return rule
    return NodeRule(rule.outputs, rule.inputs, rule.source, rule.extent, rule.size_args + ((arg, out.dim),),
                    rule.transform, rule.fixed_layout)


def _valid(rule: NodeRule, ins: list[TensorInfo], outs: list[TensorInfo | None]) -> bool:
    """Not all-Replicate, shards of dimensions of at least 2, partial sums only of floating tensors."""
    placed = [(p, i) for p, i in zip(rule.outputs, outs) if p is not None and i is not None]
    placed += list(zip(rule.inputs, ins))
    if all(p == R for p, _ in placed):
        return False
    for p, info in placed:
        if isinstance(p, Shard) and not (p.dim < info.ndim and info.shape[p.dim] >= 2):
            return False
        if p == P and not info.floating:
            return False
    return True
