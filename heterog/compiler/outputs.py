"""Memory entries per output tensor: an op instance with several outputs allocates one entry per output,
each released after its own last reader (a layer norm's output early, its mean and rstd after the backward).

A task reads an output of a multi-output producer when its dependency on the producer is owned by that
tensor (``owner = n_ops + tensor``); a dependency owned otherwise (gradient accumulation, recomputation)
reads every output. An output no op reads is released when its task ends, unless the op has no reader at all
(held to the step's end, like every output nobody reads).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from heterog.caches import DerivedCache
from heterog.compiler.index import output_bytes
from heterog.compiler.tasks import TaskKind, Tasks, ragged

if TYPE_CHECKING:  # pragma: no cover
    from heterog.graph.opgraph import OpGraph


class OutputTable:
    """Per op its outputs as CSR (``ptr`` (n_ops + 1,)), their bytes that do not scale with the batch
    (``fixed``) and that do (``batch``), whether some op reads each (``read``), ``multi`` (n_ops,) compute
    ops with two outputs or more that some op reads, ``t_out`` (n_tensors,) each tensor's output position."""

    def __init__(self, graph: OpGraph, t_op: np.ndarray) -> None:
        per_op = [(output_bytes(op), op.batch_dims) for op in graph.ops]
        counts = np.array([len(b) for b, _ in per_op], dtype=np.int64)
        self.ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = [(b, bd is None) for bs, bds in per_op for b, bd in zip(bs, bds)]
        nbytes = np.array([b for b, _ in flat], dtype=np.float64)
        fixed = np.array([f for _, f in flat], dtype=bool)
        self.fixed, self.batch = np.where(fixed, nbytes, 0.0), np.where(fixed, 0.0, nbytes)
        src_out = np.array([e.src_output for e in graph.edges], dtype=np.int64)
        src = graph.edge_src
        _, first = np.unique(src * 1024 + src_out, return_index=True)
        self.t_out = src_out[first] if len(src) else np.zeros(0, np.int64)
        self.read = np.zeros(len(nbytes), dtype=bool)
        self.read[self.ptr[t_op] + self.t_out] = True
        owner = np.repeat(np.arange(len(counts)), counts)
        self.multi = graph.is_compute & (counts >= 2) & (np.bincount(owner, self.read, len(counts)) > 0)
        self.fixed_total = np.bincount(owner, self.fixed, len(counts))
        self.batch_total = np.bincount(owner, self.batch, len(counts))


_OUTPUTS: DerivedCache[OpGraph, OutputTable] = DerivedCache("OutputTable of each graph")


def output_table(graph: OpGraph, t_op: np.ndarray) -> OutputTable:
    """The graph's ``OutputTable`` (cached on the graph)."""
    return _OUTPUTS.get(graph, lambda: OutputTable(graph, t_op))


def memory_entries(graph: OpGraph, t_op: np.ndarray, tasks: Tasks,
                   frees: tuple[np.ndarray, np.ndarray, np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The TaskGraph's memory and frees: (mem_ptr, mem_res, mem_bytes, free_ptr, free_idx, free_entry).

    ``frees`` (task, freed task, owner) sorted by task: what each task consumes. A task with memory
    allocates ``tasks.alloc`` on its device: one entry, or one per output for a compute instance of a
    ``multi`` op (its share of the batch recovered from the allocation, the entries summing to it)."""
    out = output_table(graph, t_op)
    n = tasks.n
    has_mem = (tasks.alloc > 0) & (tasks.dev >= 0)
    op = np.maximum(tasks.op, 0)
    multi = has_mem & out.multi[op] & ((tasks.kind == TaskKind.COMPUTE) | (tasks.kind == TaskKind.RECOMPUTE))
    n_out = np.diff(out.ptr)[op]
    counts = np.where(multi, n_out, has_mem.astype(np.int64))
    mem_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows, pos = ragged(counts)
    mem_res = tasks.dev[rows]
    alloc = tasks.alloc[rows]
    entry_bytes = alloc.copy()
    m = multi[rows]
    if m.any():
        o = out.ptr[op[rows[m]]] + pos[m]
        f_tot, b_tot = out.fixed_total[op[rows[m]]], out.batch_total[op[rows[m]]]
        share = np.clip(np.divide(alloc[m] - f_tot, b_tot, out=np.zeros(len(o)), where=b_tot > 0), 0.0, 1.0)
        part = out.fixed[o] + out.batch[o] * share
        total = np.bincount(rows[m], weights=part, minlength=n)[rows[m]]
        entry_bytes[m] = np.divide(part * alloc[m], total, out=alloc[m] / n_out[rows[m]], where=total > 0)
    mem_bytes = np.rint(entry_bytes).astype(np.int64)
    # each task's entries sum to its rounded allocation: the rounding difference goes to its first entry
    rounded = np.rint(tasks.alloc).astype(np.int64)
    mem_bytes[mem_ptr[:-1][has_mem]] += (rounded - np.bincount(rows, mem_bytes, n).astype(np.int64))[has_mem]
    # frees: a dependency owned by an output of a multi-output producer frees that output's entry
    f_task, f_on, f_owner = frees
    entry = np.full(len(f_task), -1, dtype=np.int64)
    tensor = f_owner - graph.n_ops
    own = multi[f_on] & (tensor >= 0) & (tensor < len(t_op))
    own[own] = t_op[tensor[own]] == tasks.op[f_on[own]]
    entry[own] = out.t_out[tensor[own]]
    # an output nobody reads, of an op read otherwise, is freed by its own task
    x = np.nonzero(multi)[0]
    xr, xk = ragged(n_out[x])
    unread = ~out.read[out.ptr[op[x[xr]]] + xk]
    f_task = np.concatenate([f_task, x[xr][unread]])
    f_on = np.concatenate([f_on, x[xr][unread]])
    entry = np.concatenate([entry, xk[unread]])
    order = np.lexsort((entry, f_on, f_task))
    f_task, f_on, entry = f_task[order], f_on[order], entry[order]
    keep = np.ones(len(f_task), dtype=bool)
    keep[1:] = (f_task[1:] != f_task[:-1]) | (f_on[1:] != f_on[:-1]) | (entry[1:] != entry[:-1])
    f_task, f_on, entry = f_task[keep], f_on[keep], entry[keep]
    free_ptr = np.concatenate([[0], np.cumsum(np.bincount(f_task, minlength=n))]).astype(np.int64)
    return mem_ptr, mem_res, mem_bytes, free_ptr, f_on.astype(np.int64), entry
