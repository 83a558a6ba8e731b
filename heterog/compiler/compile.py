"""Compile a Strategy on an OpGraph into a simulator TaskGraph (DESIGN.md section 3).

Per op, the group's ParallelConfig gives its *layout* (a list of (device, batch share)):
  - ops that touch a batch-carrying tensor are split along the batch over the config's replicas;
  - ops without any batch tensor are duplicated on every replica (parameters are present on every
    replica's device), except under PS where parameters, optimizer state and everything computed
    after gradient aggregation (the update) live on the PS device only;
  - a replicated op whose inputs carry the batch but whose output does not (weight gradient, loss)
    yields partial results; if anything reads their value, they are aggregated: PS (push to the PS,
    aggregate there) or AllReduce (ring or hierarchical, whichever the cost model says is cheaper).
Edges between different layouts become split -> transfers -> concat; a non-batch tensor needed on a
device that lacks it is transferred once per (tensor, device) from the best-connected holder.
Memory: parameters, gradients and optimizer state are resident where they live; every other output
is allocated when its task starts and freed after its last consumer (frees = data dependencies).
Resources: a compute, split, concat or aggregate task holds its device; a transfer or push holds the
links of its path and an AllReduce the links of its algorithm, plus, on devices whose own cores move
the bytes (``DeviceType.host_driven_comm``, CPU workers), those endpoint devices.

The construction is vectorised with numpy: Python loops run over distinct layouts and layout pairs,
never over replicas x edges.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from heterog.compiler.ps import build_problem, choose_ps_devices
from heterog.errors import StrategyError

VALUE_FREE_TARGETS = frozenset({
    "aten.ones_like.default", "aten.zeros_like.default", "aten.empty_like.default", "aten.full_like.default",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
})
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8,
                "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}
_STAGE = {"split": 2, "transfer": 3, "concat": 4, "compute": 6, "push": 7, "aggregate": 8}
_N_STAGES = 10


class TaskKind(IntEnum):
    COMPUTE = 0
    PLACEHOLDER = 1
    TRANSFER = 2
    SPLIT = 3
    CONCAT = 4
    PUSH = 5
    AGGREGATE = 6
    ALLREDUCE = 7


COMM_KINDS = (TaskKind.TRANSFER, TaskKind.PUSH, TaskKind.ALLREDUCE)
# Chrome-trace / Gantt categories: compute tasks by phase, communication by kind
CATEGORIES = ("forward", "backward", "update", "input", "transfer", "split/concat", "ps", "allreduce")


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise StrategyError(f"unknown dtype {dtype!r} in graph")
    return _DTYPE_BYTES[name]


# ----------------------------------------------------------------------------------- graph index
@dataclass
class GraphIndex:
    """Everything about a graph the compiler needs that does not depend on the strategy (cached).

    Aggregation is decided per *tensor* (an op output that some edge carries): a multi-output op such
    as ``convolution_backward`` yields a batch-carrying input gradient and partial weight gradients.
    """

    n_ops: int
    has_batch: np.ndarray          # op touches a batch tensor -> split along the batch
    post_agg: np.ndarray           # non-batch compute op that reads aggregated values, or update phase
    placeholder_resident: np.ndarray  # param / state / buffer placeholders (resident memory)
    is_compute: np.ndarray
    out_fixed_bytes: np.ndarray    # allocation of the op's outputs that does not scale with batch
    out_batch_bytes: np.ndarray    # allocation that scales with the batch share
    resident_bytes: np.ndarray
    category: np.ndarray           # index into CATEGORIES
    is_grad: np.ndarray
    e_src: np.ndarray
    e_dst: np.ndarray
    e_bytes: np.ndarray
    e_batch: np.ndarray            # edge tensor carries a batch
    e_value_free: np.ndarray       # consumer only needs the shape (ones_like, ...)
    e_tensor: np.ndarray           # tensor id of the edge
    t_op: np.ndarray               # producer op of each tensor
    t_bytes: np.ndarray
    t_needs_agg: np.ndarray        # partial result (batch inputs, no batch dim) whose value someone reads
    t_pulled: np.ndarray           # value of a PS-resident op (parameter, state, update) read by a batch op


def graph_index(graph) -> GraphIndex:
    cached = graph.__dict__.get("_compile_index")
    if cached is not None:
        return cached
    n = graph.n_ops
    ops = graph.ops
    out_fixed = np.zeros(n)
    out_batch = np.zeros(n)
    for i, op in enumerate(ops):
        for shape, dt, bd in zip(op.output_shapes, op.output_dtypes, op.batch_dims):
            b = float(np.prod(shape)) * dtype_bytes(dt) if len(shape) else float(dtype_bytes(dt))
            if bd is None:
                out_fixed[i] += b
            else:
                out_batch[i] += b
    is_compute = graph.is_compute.copy()
    has_batch = graph.has_batch.copy()
    is_grad = np.array([op.is_grad for op in ops], dtype=bool)
    placeholder_resident = np.array([op.kind in ("param", "state", "buffer") for op in ops], dtype=bool)
    src, dst = graph.edge_src, graph.edge_dst
    e_batch = graph.edge_has_batch.copy()
    value_free_op = np.array([op.target in VALUE_FREE_TARGETS for op in ops], dtype=bool)
    e_value_free = value_free_op[dst] if len(dst) else np.zeros(0, bool)
    src_out = np.array([e.src_output for e in graph.edges], dtype=np.int64)
    uniq, first, e_tensor = np.unique(src * 1024 + src_out, return_index=True, return_inverse=True)
    e_tensor = e_tensor.astype(np.int64)
    t_op = src[first] if len(src) else np.zeros(0, np.int64)
    t_bytes = graph.edge_bytes[first] if len(src) else np.zeros(0)
    t_partial = is_compute[t_op] & has_batch[t_op] & ~e_batch[first] if len(src) else np.zeros(0, bool)
    t_read = np.zeros(len(uniq), dtype=bool)
    np.logical_or.at(t_read, e_tensor[~e_value_free], True)
    t_needs_agg = t_partial & t_read
    # post-aggregation ops: non-batch compute ops reading (transitively) aggregated values; the update phase
    post = np.zeros(n, dtype=bool)
    phase = graph.phase_index
    valued = np.nonzero(~e_value_free)[0]
    order = valued[np.argsort(dst[valued], kind="stable")]
    for t, d in zip(e_tensor[order].tolist(), dst[order].tolist()):   # dst ascending = topological
        if (t_needs_agg[t] or post[t_op[t]]) and not has_batch[d] and is_compute[d]:
            post[d] = True
    post |= is_compute & ~has_batch & (phase == 2)
    # under PS these tensors live on the PS and are pulled by the workers' batch ops
    pulled_edge = ~e_value_free & ~e_batch & has_batch[dst] & ~has_batch[src] & (post | placeholder_resident)[src]
    t_pulled = np.zeros(len(uniq), dtype=bool)
    t_pulled[e_tensor[pulled_edge]] = True
    # allocation: resident placeholders, gradients (live in the grad buffer) and graph outputs allocate nothing
    n_consumers = np.bincount(src, minlength=n) if len(src) else np.zeros(n, int)
    no_alloc = placeholder_resident | (is_compute & (n_consumers == 0))
    out_fixed[no_alloc | is_grad] = 0.0
    out_batch[no_alloc] = 0.0
    cat = np.where(is_compute, phase, 3).astype(np.int64)
    idx = GraphIndex(n, has_batch, post, placeholder_resident, is_compute, out_fixed, out_batch,
                     graph.resident_bytes.copy(), cat, is_grad, src, dst, graph.edge_bytes.copy(), e_batch,
                     e_value_free, e_tensor, t_op, t_bytes, t_needs_agg, t_pulled)
    graph.__dict__["_compile_index"] = idx
    return idx


# ----------------------------------------------------------------------------------- cluster index
@dataclass(frozen=True)
class _Paths:
    """Routes of a cluster as TaskGraph resources: ``tab`` (M, M, Lmax) resource ids of the links on each
    path (-1 padded; links come after the M device resources), ``length`` (M, M) path lengths, ``host``
    (M,) devices that drive their own communication (``DeviceType.host_driven_comm``)."""

    tab: np.ndarray
    length: np.ndarray
    host: np.ndarray

    def resources(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(res_len, flat res_idx) of transfers ``src[i] -> dst[i]``: the links of each path, then the
        endpoints that drive their own communication (a CPU worker's cores copy the bytes, so the worker
        computes nothing else meanwhile)."""
        plen = self.length[src, dst]
        links = np.where(np.arange(self.tab.shape[2])[None, :] < plen[:, None], self.tab[src, dst], -1)
        ends = np.stack([np.where(self.host[src], src, -1), np.where(self.host[dst], dst, -1)], axis=1)
        res = np.concatenate([links, ends], axis=1)
        keep = res >= 0
        return keep.sum(axis=1), res[keep]


def _path_table(cluster) -> _Paths:
    """The cluster's ``_Paths`` (cached on the cluster)."""
    cached = cluster.__dict__.get("_compile_paths")
    if cached is not None:
        return cached
    m = cluster.n_devices
    paths = [[tuple(cluster.path(a, b)) for b in range(m)] for a in range(m)]
    lmax = max(1, max(len(p) for row in paths for p in row))
    tab = np.full((m, m, lmax), -1, dtype=np.int64)
    plen = np.zeros((m, m), dtype=np.int64)
    for a in range(m):
        for b in range(m):
            p = paths[a][b]
            plen[a, b] = len(p)
            tab[a, b, :len(p)] = np.asarray(p, dtype=np.int64) + m
    host = np.array([bool(d.type.host_driven_comm) for d in cluster.devices], dtype=bool)
    out = _Paths(tab, plen, host)
    cluster.__dict__["_compile_paths"] = out
    return out


# ----------------------------------------------------------------------------------- task buffer
class _Tasks:
    """Append-only columns of tasks under construction (ids are provisional, renumbered at the end)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                                  ("dur", "lag", "kind", "op", "dev", "alloc", "key", "cat", "prio_op")}
        self.res_len: list[np.ndarray] = []
        self.res_idx: list[np.ndarray] = []
        self.dep_task: list[np.ndarray] = []
        self.dep_on: list[np.ndarray] = []
        self.n = 0

    def add(self, *, dur, kind, op, dev, alloc, key, cat, prio_op, res_len, res_idx, lag=0.0) -> np.ndarray:
        """``lag``: seconds after a task's end until its dependents may start, its resources already free
        (a message's latency in flight; the simulator's task lag)."""
        k = len(dur)
        ids = np.arange(self.n, self.n + k, dtype=np.int64)
        self.n += k
        for name, val in (("dur", dur), ("lag", lag), ("op", op), ("dev", dev), ("alloc", alloc), ("key", key),
                          ("cat", cat), ("prio_op", prio_op)):
            self.cols[name].append(np.broadcast_to(np.asarray(val), (k,)).astype(
                np.float64 if name in ("dur", "lag", "alloc") else np.int64))
        self.cols["kind"].append(np.full(k, int(kind), dtype=np.int64))
        self.res_len.append(np.broadcast_to(np.asarray(res_len, dtype=np.int64), (k,)))
        self.res_idx.append(np.asarray(res_idx, dtype=np.int64).ravel())
        return ids

    def deps(self, task: np.ndarray, on: np.ndarray) -> None:
        self.dep_task.append(np.asarray(task, dtype=np.int64).ravel())
        self.dep_on.append(np.asarray(on, dtype=np.int64).ravel())

    def col(self, name: str) -> np.ndarray:
        return np.concatenate(self.cols[name]) if self.cols[name] else np.zeros(0)


def _cat(xs, dtype=np.int64):
    return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype=dtype)


# ----------------------------------------------------------------------------------- result
@dataclass
class CompiledPlan:
    """A TaskGraph plus what each task stands for (kind, op, device) and the resource layout."""

    tg: object                      # simulator.TaskGraph
    task_kind: np.ndarray
    task_op: np.ndarray
    task_device: np.ndarray         # compute device, or destination device of a transfer, -1 for collectives
    op_priority: np.ndarray | None  # per-op priorities from the strategy (None: ranked by the scheduler)
    task_prio_op: np.ndarray        # op whose priority a task inherits
    n_devices: int
    n_links: int
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    ps_device: dict = field(default_factory=dict)        # group -> chosen PS device
    allreduce_algo: dict = field(default_factory=dict)   # aggregated op -> "ring" | "hierarchical"
    # the layout decisions, for the runtime (which must reproduce them) and for reports
    op_layout: np.ndarray | None = None        # (n_ops,) layout id of each op's instances
    layout_devices: list = field(default_factory=list)   # layout id -> tuple of devices
    layout_shares: list = field(default_factory=list)    # layout id -> tuple of batch shares (DUP: B each)
    tensor_layout: np.ndarray | None = None    # (n_tensors,) layout whose devices hold each tensor's value
    aggregated: dict = field(default_factory=dict)       # tensor id -> ("ps", ps device) | ("allreduce", devices)

    @property
    def n_tasks(self) -> int:
        return len(self.task_kind)

    def counts(self) -> dict:
        return {k.name.lower(): int(np.sum(self.task_kind == k)) for k in TaskKind}


# ----------------------------------------------------------------------------------- compile
def compile_strategy(graph, cluster, strategy, cost, *, serialize_collectives: bool = False,
                     check: bool = True) -> CompiledPlan:
    """Build the TaskGraph of ``strategy`` for one training iteration of ``graph`` on ``cluster``.

    Args:
        graph: the OpGraph. cluster: the Cluster. strategy: a Strategy for this graph and cluster.
        cost: a CostModel of the cluster (op, transfer and collective times).
        serialize_collectives: NCCL-style: all AllReduces share one stream and run one at a time.
        check: refuse a strategy made for another graph or cluster.
    """
    import simulator

    if check:
        strategy.check_fits(graph, cluster)
    gi = graph_index(graph)
    n, m, B = gi.n_ops, cluster.n_devices, graph.batch_size
    paths = _path_table(cluster)
    bw, lat = cluster.bandwidth_Bps, cluster.latency_s
    n_links = len(cluster.links)
    nccl_res = m + n_links if serialize_collectives else -1

    # ---- per group: config id, PS device ------------------------------------------------------
    # distinct configs: by object identity first (decoded strategies share objects), then by value
    obj_ids = np.fromiter((id(c) for c in strategy.configs), dtype=np.int64, count=len(strategy.configs))
    _, first_obj, obj_inv = np.unique(obj_ids, return_index=True, return_inverse=True)
    cfg_ids: dict = {}
    obj_cfg = np.array([cfg_ids.setdefault(strategy.configs[i], len(cfg_ids)) for i in first_obj.tolist()],
                       dtype=np.int64)
    group_cfg = obj_cfg[obj_inv]
    cfgs = list(cfg_ids)
    op_group = strategy.group_of
    op_cfg = group_cfg[op_group]
    cfg_nrep = np.array([c.n_replicas for c in cfgs], dtype=np.int64)
    cfg_ps = np.array([c.sync == "ps" and c.n_replicas > 1 for c in cfgs], dtype=bool)
    replicated = cfg_nrep[op_cfg] > 1
    agg = gi.t_needs_agg & replicated[gi.t_op]          # tensors to aggregate
    group_ps = _choose_ps(graph, group_cfg, cfgs, cfg_ps, op_group, agg, gi, cost, paths, m + n_links)

    # ---- layouts --------------------------------------------------------------------------------
    lay_key: dict = {}
    lay_devs: list[tuple] = []
    lay_shares: list[tuple] = []

    def layout(devs, shares) -> int:
        key = (tuple(devs), tuple(shares))
        if key not in lay_key:
            lay_key[key] = len(lay_devs)
            lay_devs.append(key[0])
            lay_shares.append(key[1])
        return lay_key[key]

    cfg_split = np.array([layout(c.devices, c.shares) for c in cfgs], dtype=np.int64)
    cfg_dup = np.array([layout(c.devices, (B,) * c.n_replicas) for c in cfgs], dtype=np.int64)
    ps_lay = {d: layout((d,), (B,)) for d in sorted(set(group_ps.values()))}   # where PS state lives
    op_lay = np.where(gi.has_batch, cfg_split[op_cfg], cfg_dup[op_cfg])
    ps_mode = cfg_ps[op_cfg] & ~gi.has_batch & (gi.post_agg | gi.placeholder_resident)
    if ps_mode.any():
        op_lay[ps_mode] = np.array([ps_lay[group_ps[int(g)]] for g in op_group[ps_mode].tolist()], dtype=np.int64)
    L = len(lay_devs)
    lay_len = np.array([len(d) for d in lay_devs], dtype=np.int64)
    lay_ptr = np.concatenate([[0], np.cumsum(lay_len)])
    lay_dev_flat = np.array([d for ds in lay_devs for d in ds], dtype=np.int64)
    lay_frac_flat = np.array([s / B for ss in lay_shares for s in ss], dtype=np.float64)
    lay_dev_mask = np.zeros((L, m), dtype=bool)
    lay_dev_mask[np.repeat(np.arange(L), lay_len), lay_dev_flat] = True

    T = _Tasks()
    # ---- op instances ---------------------------------------------------------------------------
    counts = lay_len[op_lay]
    inst_start = np.concatenate([[0], np.cumsum(counts)])[:-1]
    n_inst = int(counts.sum())
    inst_op = np.repeat(np.arange(n), counts)
    local = np.arange(n_inst) - np.repeat(inst_start, counts)
    flat = lay_ptr[op_lay][inst_op] + local
    inst_dev = lay_dev_flat[flat]
    inst_frac = lay_frac_flat[flat]
    inst_dur = cost.op_times(graph, inst_op, inst_dev, inst_frac)
    inst_alloc = gi.out_fixed_bytes[inst_op] + gi.out_batch_bytes[inst_op] * inst_frac
    comp = gi.is_compute[inst_op]
    inst_ids = T.add(dur=inst_dur, kind=TaskKind.COMPUTE, op=inst_op, dev=inst_dev, alloc=inst_alloc,
                     key=inst_op * _N_STAGES + _STAGE["compute"], cat=gi.category[inst_op], prio_op=inst_op,
                     res_len=comp.astype(np.int64), res_idx=inst_dev[comp])
    T.cols["kind"][-1][~comp] = int(TaskKind.PLACEHOLDER)
    resident = np.bincount(inst_dev[gi.placeholder_resident[inst_op]],
                           weights=gi.resident_bytes[inst_op][gi.placeholder_resident[inst_op]], minlength=m)

    # provider of each op's output value on each device: instance task, or aggregation task
    # provider of each tensor's value on each device: the producer's instance, or an aggregation task
    prov_op = np.full((n, m), -1, dtype=np.int64)
    prov_op[inst_op, inst_dev] = inst_ids
    prov_at = prov_op[gi.t_op]
    prov_lay = op_lay[gi.t_op]        # layout whose devices hold the (aggregated) value

    # ---- gradient aggregation -------------------------------------------------------------------
    agg_t = np.nonzero(agg)[0]
    allreduce_algo: dict = {}
    if len(agg_t):
        is_ps = cfg_ps[op_cfg[gi.t_op[agg_t]]]
        _aggregate_ps(T, agg_t[is_ps], op_group, op_lay, lay_devs, group_ps, inst_start, gi, cost,
                      paths, prov_at, prov_lay, ps_lay)
        allreduce_algo = _aggregate_ar(T, agg_t[~is_ps], op_lay, lay_devs, inst_start, gi, cost, prov_at,
                                       nccl_res, m, paths)

    # ---- edges ----------------------------------------------------------------------------------
    _connect(T, graph, gi, op_lay, prov_lay, inst_start, lay_len, lay_ptr, lay_dev_flat, lay_devs, lay_shares,
             lay_dev_mask, prov_at, cost, bw, lat, paths, B)

    # ---- assemble: renumber topologically by (consumer op, stage), build the TaskGraph -----------
    key = T.col("key")
    perm = np.argsort(key, kind="stable")           # new -> old
    new_of = np.empty_like(perm)
    new_of[perm] = np.arange(len(perm))
    dep_task = new_of[_cat(T.dep_task)]
    dep_on = new_of[_cat(T.dep_on)]
    pair = np.unique(dep_task * T.n + dep_on)
    dep_task, dep_on = pair // T.n, pair % T.n
    if np.any(dep_on >= dep_task):
        raise AssertionError("compiler produced a dependency on a later task")
    dep_ptr = np.concatenate([[0], np.cumsum(np.bincount(dep_task, minlength=T.n))]).astype(np.int64)
    res_len_old = _cat(T.res_len)
    res_idx_old = _cat(T.res_idx)
    res_ptr_old = np.concatenate([[0], np.cumsum(res_len_old)])
    res_len = res_len_old[perm]
    res_ptr = np.concatenate([[0], np.cumsum(res_len)]).astype(np.int64)
    gather = np.repeat(res_ptr_old[perm], res_len) + (np.arange(res_ptr[-1]) - np.repeat(res_ptr[:-1], res_len))
    res_idx = res_idx_old[gather] if len(gather) else np.zeros(0, np.int64)

    dev = T.col("dev")[perm]
    alloc = T.col("alloc")[perm]
    has_mem = (alloc > 0) & (dev >= 0)
    mem_ptr = np.concatenate([[0], np.cumsum(has_mem)]).astype(np.int64)

    tg = simulator.TaskGraph()
    for d, device in enumerate(cluster.devices):
        tg.add_resource(device.name, memory_capacity_bytes=float(cluster.memory_bytes[d]),
                        resident_bytes=float(resident[d]))
    for link in cluster.links:
        tg.add_resource(link.name)
    if serialize_collectives:
        tg.add_resource("nccl-stream")
    dur = T.col("dur")[perm]
    tg.add_tasks(duration=dur, priority=np.zeros(T.n), res_ptr=res_ptr, res_idx=res_idx,
                 dep_ptr=dep_ptr, dep_idx=dep_on, mem_ptr=mem_ptr, mem_res=dev[has_mem],
                 mem_bytes=alloc[has_mem], free_ptr=dep_ptr, free_idx=dep_on, lag=T.col("lag")[perm],
                 cats=np.array([tg.category(c) for c in CATEGORIES], dtype=np.int64)[T.col("cat")[perm]])
    aggregated = {int(t): (("ps", group_ps[int(op_group[gi.t_op[t]])]) if cfg_ps[op_cfg[gi.t_op[t]]]
                           else ("allreduce", lay_devs[op_lay[gi.t_op[t]]])) for t in agg_t.tolist()}
    return CompiledPlan(tg=tg, task_kind=T.col("kind")[perm], task_op=T.col("op")[perm], task_device=dev,
                        op_priority=None if strategy.priorities is None else np.asarray(strategy.priorities),
                        task_prio_op=T.col("prio_op")[perm], n_devices=m, n_links=n_links,
                        dep_ptr=dep_ptr, dep_idx=dep_on, ps_device=group_ps, allreduce_algo=allreduce_algo,
                        op_layout=op_lay, layout_devices=lay_devs, layout_shares=lay_shares,
                        tensor_layout=prov_lay, aggregated=aggregated)


def _choose_ps(graph, group_cfg, cfgs, cfg_ps, op_group, agg, gi, cost, paths, n_res) -> dict:
    """PS device per PS group: the given one, or the replica chosen with the plan's other PS groups and
    AllReduces already queued on each candidate's links and aggregation (``heterog.compiler.ps``)."""
    ps_groups = np.nonzero(cfg_ps[group_cfg])[0]
    if not len(ps_groups):
        return {}
    n_groups, m = len(group_cfg), len(paths.host)
    t_group = op_group[gi.t_op]
    t_cfg = group_cfg[t_group]
    need_at = _parameters_needed(graph, gi, cfgs, cost, t_cfg, t_group, n_groups)

    def per_group(mask):
        return (np.bincount(t_group[mask], minlength=n_groups).astype(np.float64),
                np.bincount(t_group[mask], weights=gi.t_bytes[mask], minlength=n_groups))

    (n_push, b_push), (n_pull, b_pull) = per_group(agg), per_group(gi.t_pulled)
    amount = np.stack([n_push, b_push, n_pull, b_pull], axis=1)[ps_groups]
    # the plan's AllReduces: (total duration, resources) per (config, algorithm)
    allreduces = []
    ar = agg & ~cfg_ps[t_cfg]
    for c in np.unique(t_cfg[ar]).tolist():
        sel = np.nonzero(ar & (t_cfg == c))[0]
        devs = cfgs[c].devices
        times, algos = cost.allreduce_times(devs, gi.t_bytes[sel])
        algos = np.asarray(algos)
        hosts = tuple(int(d) for d in devs if paths.host[d])
        for a in sorted(set(algos.tolist())):
            res = tuple(m + x for x in cost.allreduce_links(devs, a)) + hosts
            allreduces.append((float(np.sum(times[algos == a])), res))
    fixed = {int(g): int(cfgs[group_cfg[g]].ps_device) for g in ps_groups.tolist()
             if cfgs[group_cfg[g]].ps_device is not None}
    problem = build_problem(ps_groups, [cfgs[group_cfg[g]].devices for g in ps_groups.tolist()], fixed, amount,
                            need_at[ps_groups], allreduces, cost, paths, n_res)
    return choose_ps_devices(problem, ps_groups)


def _parameters_needed(graph, gi, cfgs, cost, t_cfg, t_group, n_groups) -> np.ndarray:
    """(n_groups, M) estimated time by which each replica device needs the group's pulled parameters: its
    forward and backward work before their first reader (op ids are topological), at its batch share, one
    op after another, plus its slack (the busiest replica's work minus its own)."""
    full = cost.full_batch_times(graph)
    work = gi.is_compute & ~gi.post_agg
    need = np.zeros((n_groups, full.shape[1]))
    e = np.nonzero(~gi.e_value_free & gi.has_batch[gi.e_dst])[0]
    first_reader = np.full(len(gi.t_op), np.iinfo(np.int64).max)
    np.minimum.at(first_reader, gi.e_tensor[e], gi.e_dst[e])
    pulled = np.nonzero(gi.t_pulled & (first_reader < gi.n_ops))[0]
    for c in np.unique(t_cfg[pulled]).tolist():
        cfg, pul = cfgs[c], pulled[t_cfg[pulled] == c]
        op_s = [np.where(work, full[:, d] * np.where(gi.has_batch, share / graph.batch_size, 1.0), 0.0)
                for d, share in zip(cfg.devices, cfg.shares)]
        longest = max(float(t.sum()) for t in op_s)
        for d, t in zip(cfg.devices, op_s):
            before = np.cumsum(t) - t
            at = np.full(n_groups, np.inf)
            np.minimum.at(at, t_group[pul], before[first_reader[pul]] + longest - float(t.sum()))
            need[:, d] = np.where(np.isinf(at), need[:, d], at)      # each group is under one config
    return need


def _aggregate_ps(T, tensors, op_group, op_lay, lay_devs, group_ps, inst_start, gi, cost, paths,
                  prov_at, prov_lay, ps_lay) -> None:
    """Workers push partial results to the PS, which aggregates them; the value then lives on the PS."""
    if not len(tensors):
        return
    ops = gi.t_op[tensors]
    ps = np.array([group_ps[int(g)] for g in op_group[ops]], dtype=np.int64)
    lays = op_lay[ops]
    for lay, p in sorted(set(zip(lays.tolist(), ps.tolist()))):
        pick = (lays == lay) & (ps == p)
        sel, sel_op = tensors[pick], ops[pick]
        devs = np.array(lay_devs[lay], dtype=np.int64)
        k_ps = int(np.nonzero(devs == p)[0][0])
        workers = np.nonzero(devs != p)[0]
        nb = gi.t_bytes[sel]
        # push tasks: (tensor, worker) pairs
        src_task = (inst_start[sel_op][:, None] + workers[None, :]).ravel()
        src_dev = np.tile(devs[workers], len(sel))
        bytes_ = np.repeat(nb, len(workers))
        op_rep = np.repeat(sel_op, len(workers))
        rlen, ridx = paths.resources(src_dev, np.full(len(src_dev), p))
        push = T.add(dur=cost.transfer_times(src_dev, np.full(len(src_dev), p), bytes_), kind=TaskKind.PUSH,
                     op=op_rep, dev=p, alloc=bytes_, key=op_rep * _N_STAGES + _STAGE["push"], cat=6,
                     prio_op=op_rep, res_len=rlen, res_idx=ridx, lag=cost.transfer_latencies(src_dev, p, bytes_))
        T.deps(push, src_task)
        aggr = T.add(dur=cost.aggregate_times(p, nb, len(devs)), kind=TaskKind.AGGREGATE, op=sel_op, dev=p,
                     alloc=np.where(gi.is_grad[sel_op], 0.0, nb), key=sel_op * _N_STAGES + _STAGE["aggregate"],
                     cat=6, prio_op=sel_op, res_len=1, res_idx=np.full(len(sel), p))
        T.deps(np.repeat(aggr, len(workers)), push)
        T.deps(aggr, inst_start[sel_op] + k_ps)
        prov_at[sel] = -1
        prov_at[sel, p] = aggr
        prov_lay[sel] = ps_lay[p]


def _aggregate_ar(T, tensors, op_lay, lay_devs, inst_start, gi, cost, prov_at, nccl_res, n_dev, paths) -> dict:
    """One AllReduce per partial tensor over its replicas; it holds the links of its algorithm (and the
    members that drive their own communication)."""
    algo_of: dict = {}
    if not len(tensors):
        return algo_of
    ops = gi.t_op[tensors]
    lays = op_lay[ops]
    for lay in np.unique(lays).tolist():
        pick = lays == lay
        sel, sel_op = tensors[pick], ops[pick]
        devs = lay_devs[lay]
        times, algos = cost.allreduce_times(devs, gi.t_bytes[sel])
        algos = np.asarray(algos)
        links_of = {a: tuple(n_dev + x for x in cost.allreduce_links(devs, a)) for a in set(algos.tolist())}
        hosts = tuple(int(d) for d in devs if paths.host[d])
        res = [links_of[a] + ((nccl_res,) if nccl_res >= 0 else ()) + hosts for a in algos.tolist()]
        ar = T.add(dur=times, kind=TaskKind.ALLREDUCE, op=sel_op, dev=-1, alloc=0.0,
                   key=sel_op * _N_STAGES + _STAGE["aggregate"], cat=7, prio_op=sel_op,
                   res_len=np.array([len(r) for r in res]), res_idx=np.array([x for r in res for x in r]))
        k = len(devs)
        T.deps(np.repeat(ar, k), (inst_start[sel_op][:, None] + np.arange(k)[None, :]).ravel())
        prov_at[np.repeat(sel, k), np.tile(np.array(devs), len(sel))] = np.repeat(ar, k)
        algo_of.update({int(o): a for o, a in zip(sel_op.tolist(), algos.tolist())})
    return algo_of


def _connect(T, graph, gi, op_lay, prov_lay, inst_start, lay_len, lay_ptr, lay_dev_flat, lay_devs, lay_shares,
             lay_dev_mask, prov_at, cost, bw, lat, paths, B) -> None:
    """Dependencies and communication for every graph edge."""
    src, dst = gi.e_src, gi.e_dst
    if not len(src):
        return
    lay_u, lay_v = op_lay[src], op_lay[dst]
    same = gi.e_batch & (lay_u == lay_v)
    # (a) batch tensor, same layout: replica k feeds replica k
    e = np.nonzero(same)[0]
    if len(e):
        k = lay_len[lay_v[e]]
        er = np.repeat(e, k)
        loc = np.arange(int(k.sum())) - np.repeat(np.concatenate([[0], np.cumsum(k)])[:-1], k)
        T.deps(inst_start[dst[er]] + loc, inst_start[src[er]] + loc)
    # (b) non-batch tensor (or aggregated value): needed on each consumer replica's device
    e = np.nonzero(~gi.e_batch)[0]
    if len(e):
        _connect_nonbatch(T, gi, e, src, dst, op_lay, prov_lay, inst_start, lay_len, lay_ptr, lay_dev_flat,
                          lay_dev_mask, prov_at, cost, bw, lat, paths)
    # (c) batch tensor, different layouts: split -> transfers -> concat, once per (tensor, layout)
    e = np.nonzero(gi.e_batch & ~same)[0]
    if len(e):
        _connect_relayout(T, gi, e, src, dst, op_lay, inst_start, lay_devs, lay_shares, lay_ptr, lay_dev_flat,
                          cost, paths, B)


def _connect_nonbatch(T, gi, e, src, dst, op_lay, prov_lay, inst_start, lay_len, lay_ptr, lay_dev_flat,
                      lay_dev_mask, prov_at, cost, bw, lat, paths) -> None:
    k = lay_len[op_lay[dst[e]]]
    er = np.repeat(e, k)
    loc = np.arange(int(k.sum())) - np.repeat(np.concatenate([[0], np.cumsum(k)])[:-1], k)
    u, v, t = src[er], dst[er], gi.e_tensor[er]
    d = lay_dev_flat[lay_ptr[op_lay[v]] + loc]
    consumer = inst_start[v] + loc
    have = prov_at[t, d]
    local = have >= 0
    T.deps(consumer[local], have[local])
    miss = ~local
    vf = miss & gi.e_value_free[er]
    if vf.any():  # shape-only consumer: depend on any holder, nothing moves
        first = lay_dev_flat[lay_ptr[prov_lay[t[vf]]]]
        T.deps(consumer[vf], prov_at[t[vf], first])
    need = miss & ~gi.e_value_free[er]
    if not need.any():
        return
    u, d, v, consumer, tensor = u[need], d[need], v[need], consumer[need], t[need]
    m = prov_at.shape[1]
    # best holder: highest bandwidth to d, then lowest latency, then lowest id
    holders = lay_dev_mask[prov_lay[tensor]]                                   # (x, m)
    score_bw = np.where(holders, bw[:, d].T, -np.inf)
    best_bw = score_bw.max(axis=1, keepdims=True)
    score_lat = np.where(score_bw == best_bw, lat[:, d].T, np.inf)
    s = np.argmin(score_lat, axis=1)
    # one transfer per (tensor, destination device)
    tkey = tensor * m + d
    uniq, first_idx, inv = np.unique(tkey, return_index=True, return_inverse=True)
    first_consumer = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first_consumer, inv, v)
    tu, ts, td, tt = u[first_idx], s[first_idx], d[first_idx], tensor[first_idx]
    nb = gi.e_bytes[er[need][first_idx]]
    rlen, ridx = paths.resources(ts, td)
    tr = T.add(dur=cost.transfer_times(ts, td, nb), kind=TaskKind.TRANSFER, op=tu, dev=td, alloc=nb,
               key=first_consumer * _N_STAGES + _STAGE["transfer"], cat=4, prio_op=first_consumer,
               res_len=rlen, res_idx=ridx, lag=cost.transfer_latencies(ts, td, nb))
    T.deps(tr, prov_at[tt, ts])
    T.deps(consumer, tr[inv])


@dataclass(frozen=True)
class _Pattern:
    """How a batch tensor laid out as (devs_u, shares_u) is re-laid out as (devs_v, shares_v)."""

    pi: np.ndarray        # (P,) producer replica of each piece
    pj: np.ndarray        # (P,) consumer replica of each piece
    pov: np.ndarray       # (P,) samples in the piece
    remote: np.ndarray    # (P,) piece crosses devices -> transfer
    split_i: np.ndarray   # (S,) producer replicas cut into several pieces
    split_slot: np.ndarray  # (P,) index into split_i of the piece's producer, -1 if not split
    concat_j: np.ndarray  # (C,) consumer replicas assembled from several pieces
    concat_slot: np.ndarray  # (P,) index into concat_j of the piece's consumer, -1 if single piece


_PATTERNS: dict = {}


def _relayout_pattern(devs_u, shares_u, devs_v, shares_v) -> _Pattern:
    """Pieces (i, j, overlap) where replica i of the producer and replica j of the consumer overlap
    (cached: the same layouts recur across strategies)."""
    key = (devs_u, shares_u, devs_v, shares_v)
    pat = _PATTERNS.get(key)
    if pat is not None:
        return pat
    cu = np.concatenate([[0], np.cumsum(shares_u)])
    cv = np.concatenate([[0], np.cumsum(shares_v)])
    ov = np.minimum(cu[1:, None], cv[None, 1:]) - np.maximum(cu[:-1, None], cv[None, :-1])   # (nu, nv)
    pi, pj = np.nonzero(ov > 0)
    n_i = np.bincount(pi, minlength=len(devs_u))
    n_j = np.bincount(pj, minlength=len(devs_v))
    split_i, concat_j = np.nonzero(n_i > 1)[0], np.nonzero(n_j > 1)[0]
    slot_i = np.full(len(devs_u), -1)
    slot_i[split_i] = np.arange(len(split_i))
    slot_j = np.full(len(devs_v), -1)
    slot_j[concat_j] = np.arange(len(concat_j))
    pat = _Pattern(pi, pj, ov[pi, pj].astype(np.float64), np.asarray(devs_u)[pi] != np.asarray(devs_v)[pj],
                   split_i, slot_i[pi], concat_j, slot_j[pj])
    if len(_PATTERNS) > 4096:
        _PATTERNS.clear()
    _PATTERNS[key] = pat
    return pat


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of the given lengths: (row of each element, position within its row)."""
    rows = np.repeat(np.arange(len(counts)), counts)
    starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    return rows, np.arange(int(np.sum(counts))) - np.repeat(starts, counts)


def _connect_relayout(T, gi, e, src, dst, op_lay, inst_start, lay_devs, lay_shares, lay_ptr, lay_dev_flat,
                      cost, paths, B) -> None:
    """Split -> transfers -> concat for batch tensors consumed under another layout, once per
    (tensor, consumer layout); vectorised over all such re-layouts at once."""
    n_lay = len(lay_devs)
    ukey = gi.e_tensor[e] * n_lay + op_lay[dst[e]]
    uniq, first_idx, inv = np.unique(ukey, return_index=True, return_inverse=True)
    R = len(uniq)
    first_consumer = np.full(R, np.iinfo(np.int64).max)
    np.minimum.at(first_consumer, inv, dst[e])
    r_u = src[e][first_idx]
    r_lu, r_lv = op_lay[r_u], op_lay[dst[e][first_idx]]
    r_bytes = gi.e_bytes[e][first_idx]
    # patterns used here, flattened: pattern k's pieces/splits/concats live at offsets in the flat arrays
    pair_key = r_lu * n_lay + r_lv
    pairs, r_pat = np.unique(pair_key, return_inverse=True)
    pats = [_relayout_pattern(lay_devs[k // n_lay], lay_shares[k // n_lay], lay_devs[k % n_lay],
                              lay_shares[k % n_lay]) for k in pairs.tolist()]

    def flat(attr):
        return np.concatenate([getattr(p, attr) for p in pats])

    def ptr(attr):
        return np.concatenate([[0], np.cumsum([len(getattr(p, attr)) for p in pats])]).astype(np.int64)

    P_ptr, S_ptr, C_ptr = ptr("pi"), ptr("split_i"), ptr("concat_j")
    f_pi, f_pj, f_pov, f_rem = flat("pi"), flat("pj"), flat("pov"), flat("remote")
    f_sslot, f_cslot, f_si, f_cj = flat("split_slot"), flat("concat_slot"), flat("split_i"), flat("concat_j")
    fu = lay_ptr[r_lu]                     # flat layout offsets of producer / consumer replicas
    fv = lay_ptr[r_lv]
    base = first_consumer * _N_STAGES
    src_inst = inst_start[r_u]
    key_split, key_tr, key_cat = base + _STAGE["split"], base + _STAGE["transfer"], base + _STAGE["concat"]

    # split tasks: (instance, producer replica cut into several pieces)
    n_s = S_ptr[r_pat + 1] - S_ptr[r_pat]
    s_r, s_k = _ragged(n_s)
    s_i = f_si[S_ptr[r_pat[s_r]] + s_k]
    s_dev = lay_dev_flat[fu[s_r] + s_i]
    s_bytes = r_bytes[s_r] * _layout_frac(lay_shares, lay_ptr, r_lu[s_r], s_i, B)
    split_ids = T.add(dur=cost.copy_times(s_dev, s_bytes), kind=TaskKind.SPLIT, op=r_u[s_r], dev=s_dev,
                      alloc=s_bytes, key=key_split[s_r], cat=5, prio_op=first_consumer[s_r], res_len=1, res_idx=s_dev)
    T.deps(split_ids, src_inst[s_r] + s_i)
    split_base = np.concatenate([[0], np.cumsum(n_s)])[:-1] + (split_ids[0] if len(split_ids) else 0)

    # pieces: provider is the split task of its producer replica, else the producer instance itself
    n_p = P_ptr[r_pat + 1] - P_ptr[r_pat]
    p_r, p_k = _ragged(n_p)
    fp = P_ptr[r_pat[p_r]] + p_k
    p_i, p_j, p_rem, p_ss, p_cs = f_pi[fp], f_pj[fp], f_rem[fp], f_sslot[fp], f_cslot[fp]
    piece_task = np.where(p_ss >= 0, split_base[p_r] + p_ss, src_inst[p_r] + p_i)
    rem = np.nonzero(p_rem)[0]
    if len(rem):
        t_src = lay_dev_flat[fu[p_r[rem]] + p_i[rem]]
        t_dst = lay_dev_flat[fv[p_r[rem]] + p_j[rem]]
        t_bytes = r_bytes[p_r[rem]] * f_pov[fp[rem]] / B
        rlen, ridx = paths.resources(t_src, t_dst)
        tr = T.add(dur=cost.transfer_times(t_src, t_dst, t_bytes), kind=TaskKind.TRANSFER, op=r_u[p_r[rem]],
                   dev=t_dst, alloc=t_bytes, key=key_tr[p_r[rem]], cat=4, prio_op=first_consumer[p_r[rem]],
                   res_len=rlen, res_idx=ridx, lag=cost.transfer_latencies(t_src, t_dst, t_bytes))
        T.deps(tr, piece_task[rem])
        piece_task[rem] = tr

    # concat tasks: (instance, consumer replica assembled from several pieces)
    n_c = C_ptr[r_pat + 1] - C_ptr[r_pat]
    c_r, c_k = _ragged(n_c)
    c_j = f_cj[C_ptr[r_pat[c_r]] + c_k]
    c_dev = lay_dev_flat[fv[c_r] + c_j]
    c_bytes = r_bytes[c_r] * _layout_frac(lay_shares, lay_ptr, r_lv[c_r], c_j, B)
    concat_ids = T.add(dur=cost.copy_times(c_dev, c_bytes), kind=TaskKind.CONCAT, op=r_u[c_r], dev=c_dev,
                       alloc=c_bytes, key=key_cat[c_r], cat=5, prio_op=first_consumer[c_r], res_len=1, res_idx=c_dev)
    concat_base = np.concatenate([[0], np.cumsum(n_c)])[:-1] + (concat_ids[0] if len(concat_ids) else 0)
    in_concat = p_cs >= 0
    T.deps(concat_base[p_r[in_concat]] + p_cs[in_concat], piece_task[in_concat])

    # output of each (instance, consumer replica): its concat, else its single piece
    width = max(len(d) for d in lay_devs)
    out_task = np.full((R, width), -1, dtype=np.int64)
    out_task[p_r[~in_concat], p_j[~in_concat]] = piece_task[~in_concat]
    out_task[c_r, c_j] = concat_base[c_r] + c_k
    # consumers: replica j of each edge's consumer depends on the re-layout output j
    lay_len = np.array([len(d) for d in lay_devs], dtype=np.int64)
    er, loc = _ragged(lay_len[op_lay[dst[e]]])
    T.deps(inst_start[dst[e][er]] + loc, out_task[inv[er], loc])


def _layout_frac(lay_shares, lay_ptr, lays: np.ndarray, reps: np.ndarray, B: int) -> np.ndarray:
    """Batch fraction of replica ``reps[k]`` of layout ``lays[k]``."""
    flat_shares = np.array([s for ss in lay_shares for s in ss], dtype=np.float64)
    return flat_shares[lay_ptr[lays] + reps] / B
