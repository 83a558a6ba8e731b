"""Training-graph capture: the OpGraph of a model's training step (traced by ``heterog.graph.tracing``)
with shapes, FLOPs (``heterog.graph.flops``), bytes, batch dims, phases and parameters."""
from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from heterog.errors import HeterogError
from heterog.graph.coupling import BatchDegree, mark_batch_made_values, mixes_samples, sizes_coupled
from heterog.graph.flops import FlopCounter
from heterog.graph.fusion import VIEW_OPS, fuse_trivial
from heterog.graph.inputs import ExampleInputs
from heterog.graph.opgraph import PHASES, Edge, Op, OpGraph
from heterog.graph.optimizer import OPTIMIZERS, STATE_SLOTS, init_state, optimizer_update
from heterog.graph.random_ops import draws
from heterog.graph.tracing import CapturedStep, Sizes, capture_fx, select_loss, tensor_leaves

__all__ = ["CAPTURE_VERSION", "OPTIMIZERS", "STATE_SLOTS", "CapturedStep", "capture", "capture_fx", "graph_from_step",
           "init_state", "optimizer_update", "select_loss"]

log = logging.getLogger(__name__)

CAPTURE_VERSION = 7  # bump when the graph produced for the same model changes (cache key)


def _target_str(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))



def graph_from_step(step: CapturedStep, *, fuse: bool = True, name: str | None = None) -> OpGraph:
    """Build the OpGraph of a symbolic-mode CapturedStep: one op per placeholder and per tensor-valued fx
    node, in graph order (topological); costs and fields as documented in ``capture``."""
    if step.tracing_mode != "symbolic":
        raise HeterogError("graph_from_step needs a step traced with tracing_mode='symbolic' "
                           "(batch dimensions come from the batch symbol)")
    t0 = time.perf_counter()
    gm = step.gm
    sizes = Sizes(step.batch_symbols, step.batch_size)
    flops_of = FlopCounter(sizes)
    n_p, n_b, n_s = step.n_params, len(step.buffer_names), len(step.state_names)
    slots = STATE_SLOTS[step.optimizer]

    ops: list[Op] = []
    op_of: dict[str, int] = {}                  # fx node name -> op index (tensor-valued nodes only)
    out_pos: dict[str, dict[int, int]] = {}     # fx node name -> {index in value: output index}
    edges: list[Edge] = []
    placeholder_index = {n: i for i, n in enumerate(step.placeholders)}
    param_bytes_of: dict[str, int] = {}
    degree = BatchDegree(step.batch_symbols)
    degree_of: dict[str, int] = {}              # fx node name -> total degree of the batch in its sizes

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr" and val is None:
            val = getattr(gm, node.target, None)
        leaves = tensor_leaves(val)
        if node.op == "output" or not leaves:
            continue
        out_pos[node.name] = {idx: k for k, (idx, _) in enumerate(leaves)}
        tensors = [t for _, t in leaves]
        degree_of[node.name] = degree.of_tensors(tensors)
        shapes = [sizes.shape(t) for t in tensors]
        out_bytes = [math.prod(s) * t.dtype.itemsize for s, t in zip(shapes, tensors)]
        bdims = [sizes.batch_dim(t) for t in tensors]
        op = Op(name=node.name, target="placeholder", output_shapes=shapes,
                output_dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors], batch_dims=bdims,
                bytes_written=int(sum(out_bytes)),
                batch_bytes=int(sum(b for b, d in zip(out_bytes, bdims) if d is not None)),
                fx_nodes=[node.name])
        if node.op == "placeholder":
            i = placeholder_index[node.name]
            if i < n_p:
                pname = step.param_names[i]
                op.kind, op.param = "param", pname
                op.param_bytes = op.grad_bytes = out_bytes[0]
                param_bytes_of[pname] = out_bytes[0]
                op.module_path = _owner(pname)
            elif i < n_p + n_b:
                op.kind, op.param_bytes = "buffer", out_bytes[0]
                op.module_path = _owner(step.buffer_names[i - n_p])
            elif i < n_p + n_b + n_s:
                pname, _slot = step.state_names[i - n_p - n_b]
                op.kind, op.param, op.module_path = "state", pname, _owner(pname)
            else:
                op.kind = "input"
        elif node.op == "get_attr":
            op.kind, op.target, op.param_bytes = "buffer", "get_attr", out_bytes[0]
        else:
            op.kind, op.target = "compute", _target_str(node.target)
            op.phase = step.node_phase.get(node.name, "forward")
            op.module_path = step.node_module_path.get(node.name, "")
            in_tensors: list[tuple[int, int, int | None, int]] = []  # (src op, src output, batch dim, bytes)
            for inp in node.all_input_nodes:
                if inp.name not in op_of:
                    continue  # a shape node: sizes, not data
                src = op_of[inp.name]
                src_op = ops[src]
                if node.target is operator.getitem and inp is node.args[0]:
                    k = out_pos[inp.name].get(int(node.args[1]))
                    picks = [] if k is None else [k]
                else:
                    picks = list(range(len(src_op.output_shapes)))
                for k in picks:
                    nb = math.prod(src_op.output_shapes[k]) * _itemsize(src_op.output_dtypes[k])
                    in_tensors.append((src, k, src_op.batch_dims[k], nb))
            view = op.target in VIEW_OPS
            in_numels = [nb // max(1, _itemsize(ops[s].output_dtypes[k])) for s, k, _, nb in in_tensors]
            out_numels = [math.prod(s) for s in shapes]
            op.flops, op.flops_estimated = flops_of(node, op.target, in_numels, out_numels)
            op.draws = draws(node.target, node.args, node.kwargs)
            op.coupled = max([degree_of[node.name]] + [degree_of.get(i.name, 0) for i in node.all_input_nodes]) >= 2 \
                or mixes_samples(node, step.batch_symbols) or sizes_coupled(node, op_of, ops, degree)
            if view:
                op.bytes_read = op.bytes_written = op.batch_bytes = 0
            else:
                op.bytes_read = int(sum(nb for *_, nb in in_tensors))
                op.batch_bytes += int(sum(nb for _, _, d, nb in in_tensors if d is not None))
            for s, k, d, nb in in_tensors:
                edges.append(Edge(src=s, dst=len(ops), bytes=int(nb), batch_dim=d, src_output=k))
        op_of[node.name] = len(ops)
        ops.append(op)

    _mark_grads_and_updates(step, ops, op_of, edges)
    _mark_writers(step, ops, op_of)
    mark_batch_made_values(ops, edges)
    for op in ops:
        if op.kind == "param":
            assert op.param is not None  # named with its placeholder above
            op.state_bytes = _state_bytes(slots, param_bytes_of[op.param])
    _placeholder_phases(ops, edges)
    if flops_of.estimated_targets:
        log.warning("FLOPs estimated (no torch.utils.flop_counter formula; 1 per output element, or per input "
                    "element for reductions) for %d op types: %s", len(flops_of.estimated_targets),
                    ", ".join(sorted(flops_of.estimated_targets)))
    graph_name = name or step.model_name
    meta = {
        "model": graph_name, "torch_version": torch.__version__, "capture_version": CAPTURE_VERSION,
        "lr": step.lr, "capture_time_s": 0.0, "trace_time_s": round(step.trace_time_s, 4),
        "ops_before_fusion": len(ops), "ops_after_fusion": len(ops),
        "estimated_flop_targets": sorted(flops_of.estimated_targets),
        "inputs_without_batch": step.input_spec.unbatched if step.input_spec is not None else [],
        "random_ops": sum(op.draws for op in ops),
        "coupled_ops": sum(op.coupled for op in ops),
    }
    graph = OpGraph(name=graph_name, batch_size=step.batch_size, ops=ops, edges=edges,
                    optimizer=step.optimizer, meta=meta, assumptions=[c.record() for c in step.checks])
    if fuse:
        graph = fuse_trivial(graph)
    graph.splits = _split_options(step, graph)
    graph.meta["capture_time_s"] = round(step.trace_time_s + time.perf_counter() - t0, 4)
    return graph


def _split_options(step: CapturedStep, graph: OpGraph) -> list[dict] | None:
    """The graph's split options beyond the batch (``heterog.graph.sharding``), as plain data; None, with a
    warning, when the rules cannot be derived for this step (its groups then run unsplit)."""
    from heterog.graph.sharding import split_options, splits_to_json

    try:
        return splits_to_json(split_options(step, graph))
    except Exception as exc:  # noqa: BLE001 - a rule failure must not lose the capture
        log.warning("no split options for %s (%s: %s); its groups can only be split along the batch",
                    graph.name, type(exc).__name__, exc)
        return None


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _owner(name: str) -> str:
    """Module path owning a parameter/buffer name ("enc.fc1.weight" -> "enc.fc1")."""
    return name.rpartition(".")[0]


def _state_bytes(slots: Sequence[str], param_bytes: int) -> int:
    return int(sum(4 if s == "step" else param_bytes for s in slots))


def _mark_grads_and_updates(step: CapturedStep, ops: list[Op], op_of: dict[str, int],
                            edges: list[Edge]) -> None:
    """Gradient producers get is_grad/param; update ops get param and the param's module path."""
    for pname, gname in step.grad_nodes.items():
        if gname is not None and gname in op_of:
            op = ops[op_of[gname]]
            if not op.is_grad:
                op.is_grad, op.param = True, pname
    pred: list[list[int]] = [[] for _ in ops]
    for e in edges:
        pred[e.dst].append(e.src)
    n_p, n_slots = step.n_params, len(STATE_SLOTS[step.optimizer])
    for i, pname in enumerate(step.param_names):
        roots = [step.outputs[1 + i]] + step.outputs[1 + n_p + i * n_slots:1 + n_p + (i + 1) * n_slots]
        todo = [op_of[r] for r in roots if r in op_of]
        seen: set[int] = set()
        while todo:
            j = todo.pop()
            op = ops[j]
            if j in seen or op.kind != "compute" or op.phase != "update":
                continue
            seen.add(j)
            if op.param is None:
                op.param, op.module_path = pname, _owner(pname)
            todo.extend(pred[j])


def _mark_writers(step: CapturedStep, ops: list[Op], op_of: dict[str, int]) -> None:
    """The ops whose outputs are the step's new parameters and optimizer state name the placeholder they
    replace (``Op.writes``)."""
    n_p, n_b = step.n_params, len(step.buffer_names)
    news = list(zip(step.placeholders[:n_p], step.outputs[1:1 + n_p]))
    news += list(zip(step.placeholders[n_p + n_b:n_p + n_b + len(step.state_names)], step.outputs[1 + n_p:]))
    for ph, out in news:
        if out != ph and out in op_of and ops[op_of[out]].kind == "compute":
            ops[op_of[out]].writes = ph


def _placeholder_phases(ops: list[Op], edges: list[Edge]) -> None:
    """A placeholder's phase is that of its earliest consumer (optimizer state: update)."""
    first: dict[int, int] = {}
    for e in edges:
        op = ops[e.src]
        if op.kind != "compute" and ops[e.dst].kind == "compute":
            p = PHASES.index(ops[e.dst].phase)
            first[e.src] = min(first.get(e.src, p), p)
    for i, op in enumerate(ops):
        if op.kind != "compute":
            op.phase = PHASES[first.get(i, 0)]


# ---------------------------------------------------------------------------- entry point
def capture(module: nn.Module, example_inputs: ExampleInputs, *,
            optimizer: str = "sgd", lr: float = 0.01, fuse: bool = True, name: str | None = None) -> OpGraph:
    """Capture the training step of ``module`` as an OpGraph at the batch size of ``example_inputs``.

    ``example_inputs`` is a tensor, a tuple of tensors (positional arguments, batch on dim 0) or a dict of
    keyword arguments (``heterog.graph.inputs``: tensors without the batch among them are passed whole and
    reported once as a warning; non-tensor values are constants of the trace).

    The step traced is ``step(*params, *buffers, *opt_state, *inputs) -> (loss, *new_params, *new_state)``: ``loss``
    = the loss in ``functional_call(module, {params, buffers}, inputs)`` (``select_loss``: the output itself,
    ``output["loss"]``, ``output.loss`` or ``output[0]``; which one is logged once as a warning) must be a scalar
    (the mean loss, else ModelError; Python control flow on tensor values: DataDependentControlFlowError naming the
    model's line); ``grads = torch.autograd.grad(loss, params)``; the update is functional with the arithmetic of
    ``torch.optim``: ``sgd`` (p - lr*g, no state), ``momentum`` (SGD with momentum 0.9; state momentum_buffer) or
    ``adam`` (betas 0.9/0.999, eps 1e-8, bias correction; state exp_avg, exp_avg_sq, step per parameter). Phases:
    forward = nodes traced while computing the loss, backward = inside autograd.grad, update = the optimizer.

    Nothing is allocated: parameters, buffers, state and inputs are fake tensors made from shapes and
    dtypes, so ``module`` may live on the meta device. One symbolic-batch trace
    (``capture_fx(..., tracing_mode="symbolic")``) makes dim 0 of every batch input one symbol; a tensor's
    batch dim is the first dim whose size depends on it (``(B, S, H) -> (B*S, H)``: dim 0), wherever the
    tensor comes from (an input, a buffer expanded to the input's batch size, ``new_zeros`` or ``arange`` of
    it). A traced step that writes into an intermediate value and reads it again (``copy_`` into a slice) is
    re-traced functionalised (``heterog.graph.mutations``), so that the write is an edge of the graph.
    ``Op.fx_nodes`` name nodes of that GraphModule (tracing is deterministic: a later ``capture_fx`` of the
    same model and inputs names them the same).

    Costs per op: ``flops`` from ``torch.utils.flop_counter`` formulas (by overload packet, at the concrete
    input shapes and ``out_shape``), with the fixes and additions of ``_extra_flop_formulas`` (grouped
    convolution backward, CPU SDPA kernels); ops with no formula get an
    estimate and ``flops_estimated=True`` (one FLOP per element of the largest input for reductions and
    normalisations, ``REDUCTION_OPS``; one per output element otherwise), and their targets are logged as
    one warning. View-like ops (``fusion.VIEW_OPS``) cost zero FLOPs and bytes. ``bytes_read`` = bytes of the
    distinct tensor inputs, ``bytes_written`` = bytes of the outputs (numel * itemsize), ``batch_bytes`` =
    the part of both whose tensors carry the batch. Placeholders (kind param/buffer/state/input) have zero
    FLOPs and ``bytes_written`` = the tensor they provide; a param op carries ``param_bytes``,
    ``grad_bytes`` (= param bytes) and ``state_bytes`` (its whole optimizer state); state placeholders carry
    ``param`` = the parameter they serve and no resident bytes (counted on the param op). Gradient producers
    have ``is_grad`` and ``param``; update ops have ``param`` and the parameter's module path.

    ``fuse`` merges zero-cost view ops into their producers (``heterog.graph.fusion.fuse_trivial``).
    ``graph.meta`` has model, torch_version, capture_time_s, ops_before_fusion, ops_after_fusion.
    """
    t0 = time.perf_counter()
    step = capture_fx(module, example_inputs, optimizer=optimizer, lr=lr, tracing_mode="symbolic")
    graph = graph_from_step(step, fuse=fuse, name=name)
    graph.meta["capture_time_s"] = round(time.perf_counter() - t0, 4)
    return graph
