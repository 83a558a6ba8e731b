"""Trivial-op fusion: merge zero-cost view ops (view, transpose, expand, getitem, ...) into the op that
produces their input, so that every remaining op does real work. Works on OpGraph alone (no torch)."""
from __future__ import annotations

from dataclasses import replace

from heterog.graph.opgraph import Edge, Op, OpGraph

# Overload packets whose ops only re-describe their input's storage (no data moved, no FLOPs).
# ``_unsafe_view`` reshapes a fresh tensor in place; copies (clone, _to_copy, contiguous) are not listed.
VIEW_PACKETS = frozenset({
    "aten.view", "aten._unsafe_view", "aten._reshape_alias", "aten.t", "aten.transpose", "aten.permute",
    "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.alias", "aten.detach", "aten.slice",
    "aten.select", "aten.as_strided", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk",
    "aten.narrow", "aten.diagonal", "aten.unfold", "aten.view_as_real", "aten.view_as_complex",
    "aten.real", "aten.imag", "aten.lift_fresh", "aten.movedim", "aten.swapaxes", "aten.swapdims",
    "aten.unflatten", "aten.tensor_split", "aten.numpy_T", "aten.mT", "aten.adjoint", "getitem",
})


class _ViewOps:
    """Membership by target string: "aten.view.default" is a view because "aten.view" is listed."""

    def __contains__(self, target: object) -> bool:
        if not isinstance(target, str):
            return False
        return target in VIEW_PACKETS or target.rpartition(".")[0] in VIEW_PACKETS


VIEW_OPS = _ViewOps()


def fuse_trivial(graph: OpGraph) -> OpGraph:
    """Merge every view-like compute op with a single producer into that producer's op.

    A view has exactly one tensor input, so merging it into its producer cannot create a cycle, and
    ordering the merged ops by their producer's index keeps a topological numbering.

    A view whose output carries the batch while its input does not (``expand`` of a buffer to the input's
    batch size) is not merged: it is the first op of the batch there, and runs at each replica's share.

    A view tagged with a parameter (a gradient) is not merged into an op already tagged with another
    parameter: an op holds one parameter's gradient, so the second gradient of a multi-output op
    (layer-norm or convolution backward) stays a zero-cost op of its own.

    The merged op keeps the producer's name, target, phase, outputs and costs (views add none);
    ``fx_nodes`` lists all merged fx nodes in execution order; ``is_grad``/``param`` carry over from a
    merged view that returns a parameter's gradient. A consumer of a view gets an edge from the merged op
    with the bytes and batch dim of the tensor it actually consumes and ``src_output`` = the producer output
    the view derives from; one edge per (merged op, output, consumer). A consumer of several views of one
    output (the query, key and value picked from one projection) reads all of them: its edge carries their
    bytes summed, at most the whole output's (but never less than its largest view: an expanded one). Ops
    are renumbered topologically (by producer index) and ``meta`` records
    ``ops_before_fusion``/``ops_after_fusion``.
    """
    n = graph.n_ops
    preds: list[set[int]] = [set() for _ in range(n)]
    in_edge: list[Edge | None] = [None] * n
    for edge in graph.edges:
        preds[edge.dst].add(edge.src)
        in_edge[edge.dst] = edge
    rep = list(range(n))          # op -> index of the op it is merged into
    origin = [0] * n              # op -> output index of rep that its (first) output derives from
    group_param = [op.param for op in graph.ops]   # the one parameter a merged op may be tagged with
    for i, op in enumerate(graph.ops):
        e = in_edge[i]
        if e is None or op.kind != "compute" or op.target not in VIEW_OPS or len(preds[i]) != 1:
            continue
        if e.batch_dim is None and any(d is not None for d in op.batch_dims):
            continue  # the view brings in the batch (a buffer expanded to the input's batch size)
        r = rep[e.src]
        if op.param is not None and group_param[r] not in (None, op.param):
            continue  # e.g. the bias gradient picked from a layer norm backward that also gives the weight's
        rep[i] = r
        origin[i] = origin[e.src] if r != e.src else e.src_output
        group_param[r] = group_param[r] or op.param
    keep = [i for i in range(n) if rep[i] == i]
    new_index = {old: k for k, old in enumerate(keep)}
    members: dict[int, list[int]] = {i: [] for i in keep}
    for i in range(n):
        members[rep[i]].append(i)

    ops: list[Op] = []
    for i in keep:
        base = graph.ops[i]
        group = [graph.ops[j] for j in members[i]]
        grad = next((o for o in group if o.is_grad), None)
        ops.append(replace(
            base,
            fx_nodes=[name for o in group for name in (o.fx_nodes or [o.name])],
            flops=float(sum(o.flops for o in group)),
            flops_estimated=any(o.flops_estimated for o in group),
            bytes_read=int(sum(o.bytes_read for o in group)),
            bytes_written=int(sum(o.bytes_written for o in group)),
            batch_bytes=int(sum(o.batch_bytes for o in group)),
            is_grad=base.is_grad or grad is not None,
            draws=any(o.draws for o in group),
            writes=next((o.writes for o in group if o.writes is not None), None),
            coupled=any(o.coupled for o in group),
            param=base.param if base.param is not None or grad is None else grad.param,
            output_shapes=[list(s) for s in base.output_shapes],
            output_dtypes=list(base.output_dtypes),
            batch_dims=list(base.batch_dims),
        ))

    whole: dict[tuple[int, int], int] = {}      # (kept op, output) -> its bytes, as an edge out of it carries them
    for e in graph.edges:
        if rep[e.src] == e.src:
            whole[(e.src, e.src_output)] = max(whole.get((e.src, e.src_output), 0), int(e.bytes))
    merged: dict[tuple[int, int, int], Edge] = {}
    read: dict[tuple[int, int, int], dict[int, int]] = {}     # merged edge -> bytes of each view it reads
    for e in graph.edges:
        s, d = rep[e.src], rep[e.dst]
        if s == d:
            continue
        k = e.src_output if e.src == s else origin[e.src]
        key = (new_index[s], k, new_index[d])
        views = read.setdefault(key, {})
        views[e.src] = max(views.get(e.src, 0), int(e.bytes))
        nbytes = max(max(views.values()), min(sum(views.values()), whole.get((s, k), 0)))
        old = merged.get(key)
        if old is None:
            merged[key] = Edge(src=key[0], dst=key[2], bytes=nbytes, batch_dim=e.batch_dim, src_output=k)
        else:
            old.bytes = nbytes
            if old.batch_dim is None:
                old.batch_dim = e.batch_dim
    edges = sorted(merged.values(), key=lambda e: (e.dst, e.src, e.src_output))
    meta = {**graph.meta, "ops_before_fusion": graph.meta.get("ops_before_fusion", n), "ops_after_fusion": len(ops)}
    return OpGraph(name=graph.name, batch_size=graph.batch_size, ops=ops, edges=edges,
                   optimizer=graph.optimizer, meta=meta, assumptions=list(graph.assumptions))
