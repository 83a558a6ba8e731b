"""The tasks and memory of sharded data-parallel state (ZeRO stages, FSDP; ``heterog.sharded``): which
ops a group's stage touches, their shares, and the reduce-scatters and all-gathers it adds.

Semantics: docs/design.md, "Sharded state". Replica i of a sharded config holds the fraction f_i =
w_i / sum(w) of every sharded tensor of its group. Stage >= 1: the optimizer state is held in shards,
each replica's update ops that work on whole tensors (not the scalar step counters) take f_i of their
time and allocation, and the updated parameter is all-gathered (one COLLECTIVE per parameter, after the
op that writes it) unless stage 3 keeps it sharded. Stage >= 2: a gradient is reduce-scattered instead of
all-reduced (each replica keeps its shard; the op that makes the full local gradient allocates it, and the
reduce-scatter works in that buffer until the update has read the device's shard:
``heterog.compiler.memory``). Stage 3: the parameter is held in shards; before its first reader in forward
and again before its first reader in backward it is all-gathered (a COLLECTIVE that lands on each device
as a zero-time task allocating the whole parameter beside the device's own shard; freed after that
phase's readers on the device; a reader on a device outside the config receives it whole by a
transfer). A gather
waits for a zero-time SYNC trigger: the ops two hops (batch edges of the same phase) before the phase's
first reader have run, so the gather overlaps the op before the reader (FSDP's prefetch of the next
layer) and holds the parameter only around its use. Uneven shards are priced hop by hop
(``CostModel.sharded_ring_times``) and hold a ring's links.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.caches import DerivedCache
from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine
from heterog.compiler.registries import ConfigTable, LayoutTable
from heterog.compiler.tasks import Deps, Providers, TaskKind, Tasks, ragged
from heterog.placement import P, R, Shard, conversion
from heterog.shares import split_shares_of

if TYPE_CHECKING:  # pragma: no cover
    from heterog.graph.opgraph import OpGraph

# ``heterog.compiler.offload.shard_uploads``: (ctx, engine, state, parameter, phase, devices, after, prio_op, owner)
# -> the copies up of the devices' shards, or None where the parameter is on the GPUs
Uploads = Callable[[CompileContext, Engine, "StatePlacement", int, int, tuple[int, ...], np.ndarray, int, int],
                   "np.ndarray | None"]


# where a group's state lives (``ShardedState.offload``) as ``StatePlacement.op_offload`` codes
OFFLOAD_CODES = {"none": 0, "optimizer": 1, "parameters": 2}
# a stage-3 gather's tasks within its tensor, per phase ph: the trigger (sub 2 ph) and the all-gather (2 ph + 1);
# with offloaded parameters the copies up in between (UPLOAD_SUB + ph M + d), the all-gather after them
# (UPLOAD_SUB + 2 M + ph)
UPLOAD_SUB = 4


@dataclass(frozen=True)
class StatePlacement:
    """The sharded state of a plan: ``op_stage`` (n_ops,) the stage of each op's group (0: none);
    ``op_row`` (n_ops,) the row of its config in ``frac`` (-1: none), ``frac`` (K, M) each device's part
    of the sharded tensors of the K sharded configs (0 off the config), ``devices`` (K,) their devices;
    ``trig_tensor``, ``trig_op`` (T,) the stage-3 parameters' tensors and the ops their gathers wait for
    (a change of such an op's group re-emits the tensor's edges, ``heterog.compiler.delta``);
    ``op_offload`` (n_ops,) where its group's state lives: 0 the GPU, 1 the optimizer state on the host, 2
    and the parameters (``heterog.compiler.offload``). Stage 0 rows (offloading only) have ``frac`` 1.
    ``weights`` (K,) each config's integer shard weights (``ShardedState.weights``), from which the runtime
    cuts whole rows (``heterog.runtime.state_lowering``). ``rs_prev``, ``rs_wait`` (n_tensors,) per
    reduce-scattered gradient the gradient of its config reduce-scattered before it and the one whose
    reduce-scatter its maker waits for (-1: none; ``reduce_scatter_order``). ``op_frac`` (n_ops,) the row of
    ``frac`` with the parts of the tensors of each op's parameter: its whole rows as the runtime cuts them
    (``split_shares_of(rows, weights)``, rows K and on), or its config's fractions where the parameter has
    fewer rows than replicas (``frac_row``)."""

    op_stage: np.ndarray
    op_row: np.ndarray
    frac: np.ndarray
    devices: tuple[tuple[int, ...], ...]
    trig_tensor: np.ndarray
    trig_op: np.ndarray
    op_offload: np.ndarray
    weights: tuple[tuple[int, ...], ...] = ()
    rs_prev: np.ndarray | None = None
    rs_wait: np.ndarray | None = None
    op_frac: np.ndarray | None = None

    def frac_row(self, ops: np.ndarray | int) -> np.ndarray:
        """The rows of ``frac`` with the parts of ``ops``' parameters' tensors (``op_frac``)."""
        return (self.op_row if self.op_frac is None else self.op_frac)[ops]


@dataclass(frozen=True)
class StateIndex:
    """What the graph fixes for sharded state (cached on the context): ``scaled_update`` (n_ops,) update
    ops over whole tensors; ``new_param`` (n_ops,) the param placeholder whose next value an update op
    writes (-1: none); ``param_tensor`` (n_ops,) a param placeholder's output tensor (-1: none);
    ``param_bytes``, ``grad_bytes``, ``state_bytes`` (n_ops,) resident parts; ``trigger[phase][p]`` the
    ops a stage-3 gather of parameter p before ``phase`` (0 forward, 1 backward) waits for; ``rows``
    (n_ops,) the size of dim 0 of the parameter an op belongs to (0: none, or a scalar)."""

    scaled_update: np.ndarray
    new_param: np.ndarray
    param_tensor: np.ndarray
    param_bytes: np.ndarray
    grad_bytes: np.ndarray
    state_bytes: np.ndarray
    trigger: tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]
    pred: dict[int, frozenset[int]]
    rows: np.ndarray

    def before(self, v: int) -> frozenset[int]:
        """The compute ops two hops (batch edges of one phase) before op ``v`` (one hop where there are no
        two): what a gather for ``v`` waits for."""
        return _two_hops(self.pred, v)


def _two_hops(pred: dict[int, frozenset[int]], v: int) -> frozenset[int]:
    hop1 = pred.get(v, frozenset())
    hop2 = frozenset().union(*(pred.get(u, frozenset()) for u in hop1))
    return hop2 or hop1


_STATE_INDEX: DerivedCache[OpGraph, StateIndex] = DerivedCache("StateIndex of each graph")


def state_index(ctx: CompileContext) -> StateIndex:
    """The graph's ``StateIndex`` (kept per graph)."""
    return _STATE_INDEX.get(ctx.graph, lambda: _build_state_index(ctx))


def _build_state_index(ctx: CompileContext) -> StateIndex:
    gi, ops = ctx.index, ctx.graph.ops
    phase = ctx.graph.phase_index
    n = gi.n_ops
    is_param = np.array([op.kind == "param" for op in ops], dtype=bool)
    whole = np.array([bool(op.output_shapes) and int(np.prod(op.output_shapes[0])) > 1 for op in ops], dtype=bool)
    scaled = gi.is_compute & (phase == 2) & whole & np.array([op.param is not None for op in ops], dtype=bool)
    new_param = np.full(n, -1, dtype=np.int64)
    src, dst = gi.e_src, gi.e_dst
    writes = is_param[src] & (phase[dst] == 2) & gi.is_compute[dst]
    new_param[dst[writes]] = src[writes]
    param_tensor = np.full(n, -1, dtype=np.int64)
    param_tensor[gi.t_op[is_param[gi.t_op]]] = np.nonzero(is_param[gi.t_op])[0]
    preds: dict[int, set[int]] = {}
    for u, v in zip(src[gi.e_batch].tolist(), dst[gi.e_batch].tolist()):
        if gi.is_compute[u] and phase[u] == phase[v]:
            preds.setdefault(v, set()).add(u)
    pred = {v: frozenset(us) for v, us in preds.items()}
    trigger: tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]] = ({}, {})
    for ph in (0, 1):
        read = is_param[src] & (phase[dst] == ph) & gi.is_compute[dst]
        first = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(first, src[read], dst[read])
        for p in np.nonzero(first < n)[0].tolist():
            trigger[ph][p] = tuple(sorted(_two_hops(pred, int(first[p]))))
    dim0 = {op.param: int(op.output_shapes[0][0]) for op in ops
            if op.kind == "param" and op.output_shapes and len(op.output_shapes[0]) > 0}
    rows = np.array([dim0.get(op.param, 0) if op.param is not None else 0 for op in ops], dtype=np.int64)
    return StateIndex(scaled, new_param, param_tensor,
                      np.array([op.param_bytes for op in ops], dtype=np.float64),
                      np.array([op.grad_bytes for op in ops], dtype=np.float64),
                      np.array([op.state_bytes for op in ops], dtype=np.float64), trigger, pred, rows)


def place_state(ctx: CompileContext, configs: ConfigTable, op_cfg: np.ndarray,
                aggregate: np.ndarray) -> StatePlacement | None:
    """The plan's ``StatePlacement`` (None when no group keeps sharded or offloaded state); ``aggregate``
    (n_tensors,) the partial results the plan sums over replicas."""
    used = [k for k in np.unique(op_cfg).tolist() if configs.configs[k].sharded is not None]
    if not used:
        return None
    si = state_index(ctx)
    n = len(op_cfg)
    op_stage = np.zeros(n, dtype=np.int64)
    op_row = np.full(n, -1, dtype=np.int64)
    op_offload = np.zeros(n, dtype=np.int64)
    frac = np.zeros((len(used), ctx.n_devices))
    devices, weights = [], []
    for row, k in enumerate(used):
        cfg = configs.configs[k]
        assert cfg.sharded is not None
        sel = op_cfg == k
        op_stage[sel], op_row[sel] = int(cfg.sharded.stage), row
        op_offload[sel] = OFFLOAD_CODES[cfg.sharded.offload]
        frac[row, list(cfg.devices)] = cfg.sharded.fractions if int(cfg.sharded.stage) else 1.0
        devices.append(tuple(cfg.devices))
        weights.append(tuple(int(w) for w in cfg.sharded.weights))
    frac, op_frac = whole_rows(si, op_row, op_stage, frac, devices, weights)
    pairs = [(int(si.param_tensor[p]), q) for ph in (0, 1) for p, qs in si.trigger[ph].items()
             if op_stage[p] == 3 for q in qs]
    tt = np.array([a for a, _ in pairs], dtype=np.int64)
    to = np.array([b for _, b in pairs], dtype=np.int64)
    rs_prev, rs_wait = reduce_scatter_order(ctx, op_stage, op_row, aggregate)
    return StatePlacement(op_stage, op_row, frac, tuple(devices), tt, to, op_offload, tuple(weights),
                          rs_prev, rs_wait, op_frac)


def whole_rows(si: StateIndex, op_row: np.ndarray, op_stage: np.ndarray, frac: np.ndarray,
               devices: list[tuple[int, ...]], weights: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """``frac`` with a row per (config, rows of a parameter) that the runtime divides in whole rows (stage >= 1,
    at least as many rows as replicas: ``split_shares_of(rows, weights)[i] / rows`` on replica i) and each
    op's row in it (``StatePlacement.op_frac``)."""
    op_frac = op_row.copy()
    cut = (op_row >= 0) & (op_stage > 0) & (si.rows > 0)
    lens = np.array([len(d) for d in devices], dtype=np.int64)
    cut[cut] &= (lens[op_row[cut]] > 1) & (si.rows[cut] >= lens[op_row[cut]])
    if not cut.any():
        return frac, op_frac
    pairs, inv = np.unique(np.stack([op_row[cut], si.rows[cut]]), axis=1, return_inverse=True)
    extra = np.zeros((pairs.shape[1], frac.shape[1]))
    for k, (row, rows) in enumerate(pairs.T.tolist()):
        extra[k, list(devices[row])] = np.asarray(split_shares_of(rows, weights[row]), dtype=np.float64) / rows
    op_frac[cut] = len(frac) + inv.reshape(-1)
    return np.concatenate([frac, extra]), op_frac


def reduce_scatter_order(ctx: CompileContext, op_stage: np.ndarray, op_row: np.ndarray,
                         aggregate: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(rs_prev, rs_wait) of ``StatePlacement`` (None, None where no gradient is reduce-scattered). A config's
    gradients are reduce-scattered on one communicator in the order the backward makes them (op order), each
    after the one before, as NCCL runs a process group's collectives; and the backward waits rather than hold
    more than two of the config's largest gradients made and not yet reduce-scattered (the two reduction
    buffers of DeepSpeed's overlapped reduction, each the size of the largest gradient): the op making
    gradient j waits for the reduce-scatter of the latest gradient i < j with bytes(i..j) over that bound."""
    gi = ctx.index
    tensors = np.nonzero(aggregate & gi.is_grad[gi.t_op] & (op_stage[gi.t_op] >= 2))[0]
    if not len(tensors):
        return None, None
    rs_prev = np.full(gi.n_tensors, -1, dtype=np.int64)
    rs_wait = np.full(gi.n_tensors, -1, dtype=np.int64)
    rows = op_row[gi.t_op[tensors]]
    for row in np.unique(rows).tolist():
        ts = tensors[rows == row]
        ts = ts[np.lexsort((ts, gi.t_op[ts]))]          # the backward's order: by the op that makes them
        rs_prev[ts[1:]] = ts[:-1]
        b = gi.t_bytes[ts]
        bound = 2.0 * float(b.max())
        ends = np.cumsum(b)                             # bytes(i..j) = ends[j] - ends[i] + b[i]
        starts = ends - b
        # the latest i with starts[i] < ends[j] - bound, i.e. bytes(i..j) > bound
        i = np.searchsorted(starts, ends - bound, side="left") - 1
        wait = i >= 0
        rs_wait[ts[wait]] = ts[i[wait]]
    return rs_prev, rs_wait


# ----------------------------------------------------------------------------------- instances and memory
def scale_instances(ctx: CompileContext, state: StatePlacement, inst_op: np.ndarray, inst_dev: np.ndarray,
                    dur: np.ndarray, alloc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Instances' (dur, alloc) under sharded state: update ops over whole tensors at the device's part (the
    op making a gradient allocates the full local gradient at every stage)."""
    si = state_index(ctx)
    stage = state.op_stage[inst_op]
    f = np.where(state.op_row[inst_op] >= 0, state.frac[np.maximum(state.frac_row(inst_op), 0), inst_dev], 1.0)
    upd = (stage > 0) & si.scaled_update[inst_op]
    dur = np.where(upd, dur * f, dur)
    alloc = np.where(upd, alloc * f, alloc)
    return dur, alloc


def resident_saved(ctx: CompileContext, layouts: LayoutTable, op_lay: np.ndarray,
                   state: StatePlacement) -> np.ndarray:
    """(M,) resident bytes each device does not hold because they are sharded: of each parameter of a
    sharded group, (1 - f) of its optimizer state and at stage 3 of itself (gradients are not resident:
    allocated when made)."""
    si = state_index(ctx)
    ops = np.nonzero((state.op_stage > 0) & (si.param_tensor >= 0))[0]
    out = np.zeros(ctx.n_devices)
    for o in ops.tolist():
        st = int(state.op_stage[o])
        sharded = si.state_bytes[o] + (si.param_bytes[o] if st >= 3 else 0.0)
        devs = np.array(layouts.unique_devices(int(op_lay[o])), dtype=np.int64)
        out[devs] += sharded * (1.0 - state.frac[state.frac_row(o), devs])
    return out


# ----------------------------------------------------------------------------------- collectives
# the state's placements over a group's replicas: rows of each tensor in shards of the config's fractions
ROWS = Shard(0)
SCATTER = conversion(P, ROWS, True)          # a gradient's partial sums into each replica's rows
GATHER = conversion(ROWS, R, True)           # a parameter's rows made whole on each replica


def reduce_scattered(ctx: CompileContext, state: StatePlacement | None, tensors: np.ndarray) -> np.ndarray:
    """(len(tensors),) the partial results among ``tensors`` that stage >= 2 reduce-scatters: gradients."""
    if state is None:
        return np.zeros(len(tensors), dtype=bool)
    ops = ctx.index.t_op[tensors]
    return (state.op_stage[ops] >= 2) & ctx.index.is_grad[ops]


def gradient_shares(ctx: CompileContext, state: StatePlacement | None) -> np.ndarray | None:
    """(n_ops, n_devices) each device's share of the gradient an op makes where the device keeps only its
    rows of it once aggregated (1 elsewhere; ``heterog.compiler.memory``), None where none does: stage >= 2
    reduce-scatters the gradient; stage 1 on the device all-reduces it, and each replica then takes its rows
    of the sum and lets the whole go, as ZeRO-1 keeps its partition of the reduced gradient
    (``heterog.runtime.state_lowering``: the rows are taken at the AllReduce's end). Offloaded stage 1 keeps
    the whole to its copy down."""
    if state is None:
        return None
    kept = ((state.op_stage >= 2) | ((state.op_stage == 1) & (state.op_offload == 0))) & ctx.index.is_grad
    if not kept.any():
        return None
    out = np.ones((ctx.index.n_ops, ctx.n_devices))
    out[kept] = state.frac[state.frac_row(kept)]
    return out


def emit_reduce_scatter(ctx: CompileContext, layouts: LayoutTable, conv: Engine, tensors: np.ndarray,
                        op_lay: np.ndarray, state: StatePlacement, prov: Providers) -> None:
    """One reduce-scatter per gradient among ``tensors`` over its replicas, after each device's last
    (accumulated) instance; each device then reads its shard from it."""
    gi = ctx.index
    ops = gi.t_op[tensors]
    lays = op_lay[ops]
    for lay in np.unique(lays).tolist():
        pick = lays == lay
        sel, sel_op = tensors[pick], ops[pick]
        devs = layouts.unique_devices(lay)
        last = layouts.last_entries(lay)
        rs = conv.collective(SCATTER, devs, gi.t_bytes[sel], prov.inst_start[sel_op][:, None] + last[None, :],
                             op=sel_op, tensor=sel, prio_op=sel_op, stage="aggregate", cls=0, sub=0, owner=sel_op,
                             need=state.frac[state.frac_row(sel_op[0]), list(devs)])
        k = len(devs)
        prov.at[np.repeat(sel, k), np.tile(np.array(devs), len(sel))] = np.repeat(rs, k)
    # the config's order (``reduce_scatter_order``): after the one before; the maker's last instances after
    # the one beyond the buffers
    assert state.rs_prev is not None and state.rs_wait is not None
    first_dev = np.array([layouts.unique_devices(int(k))[0] for k in op_lay[ops].tolist()], dtype=np.int64)
    prev = state.rs_prev[tensors]
    on = prev >= 0
    conv.deps(prov.at[tensors[on], first_dev[on]], prov.at[prev[on], first_dev[on]], ops[on])
    wait = state.rs_wait[tensors]
    for j in np.nonzero(wait >= 0)[0].tolist():
        last = layouts.last_entries(int(op_lay[ops[j]]))
        conv.deps(prov.inst_start[ops[j]] + last, np.full(len(last), prov.at[wait[j], first_dev[j]]), int(ops[j]))


def emit_update_gathers(ctx: CompileContext, layouts: LayoutTable, conv: Engine, ops: np.ndarray,
                        op_lay: np.ndarray, state: StatePlacement, prov: Providers,
                        ready: dict[int, np.ndarray] | None = None) -> None:
    """Stages 1 and 2: after the update op among ``ops`` that writes a parameter's next value, one
    all-gather of the parameter over its config's replicas (into the resident parameter: no allocation);
    ``ready``: writer op -> the tasks, one per device (its last entries), that the gather waits for
    instead of the writer's instances (the copies up of offloaded state)."""
    si = state_index(ctx)
    writer = ops[(si.new_param[ops] >= 0) & np.isin(state.op_stage[ops], (1, 2))]
    for o in writer.tolist():
        p = int(si.new_param[o])
        lay = int(op_lay[o])
        devs = layouts.unique_devices(lay)
        if len(devs) < 2:
            continue
        after = ready[o] if ready is not None and o in ready else prov.inst_start[o] + layouts.last_entries(lay)
        conv.collective(GATHER, devs, si.param_bytes[p], after[None, :], op=o, tensor=int(si.param_tensor[p]),
                        prio_op=o, stage="aggregate", cls=0, sub=0, owner=o,
                        have=state.frac[state.frac_row(o), list(devs)])


def update_gather_readers(ctx: CompileContext, tasks: Tasks, deps: Deps, state: StatePlacement
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(gather, reader) pairs: each all-gather of a parameter's next value (stages 1 and 2,
    ``emit_update_gathers``), which lands in the resident parameter, and every task that reads the parameter
    (what must run before the gather overwrites it: ``heterog.compiler.plan.overwrite_after_reads``)."""
    si = state_index(ctx)
    task, _, owner = deps
    opc = np.maximum(tasks.op, 0)
    gather = np.nonzero((tasks.kind == TaskKind.COLLECTIVE) & (tasks.op >= 0) & (si.new_param[opc] >= 0) &
                        np.isin(state.op_stage[opc], (1, 2)))[0]
    if not len(gather):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    read = ctx.index.n_ops + si.param_tensor[si.new_param[tasks.op[gather]]]     # the owner of a read of it
    by_owner = np.argsort(owner, kind="stable")
    lo, hi = np.searchsorted(owner[by_owner], read, "left"), np.searchsorted(owner[by_owner], read, "right")
    r, k = ragged(hi - lo)
    return gather[r], task[by_owner[lo[r] + k]]


def gathered_edges(ctx: CompileContext, state: StatePlacement | None, edges: np.ndarray) -> np.ndarray:
    """(len(edges),) the edges from a stage-3 parameter to a forward or backward reader."""
    if state is None:
        return np.zeros(len(edges), dtype=bool)
    gi = ctx.index
    src = gi.e_src[edges]
    return (state.op_stage[src] == 3) & (state_index(ctx).param_tensor[src] >= 0) & \
        (ctx.graph.phase_index[gi.e_dst[edges]] < 2)


def connect_gathered(ctx: CompileContext, layouts: LayoutTable, conv: Engine, edges: np.ndarray,
                     op_lay: np.ndarray, state: StatePlacement, prov: Providers,
                     uploads: Uploads | None = None,
                     recompute: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                     ) -> None:
    """Stage 3: per parameter and phase (forward, backward) of ``edges``' readers, a SYNC trigger, an
    all-gather of the shards, and the whole parameter landing on each reader device of the config (but for
    its own shard, in place) or moved whole from the config's first device to a reader device outside it;
    each reader instance waits for its device's copy (module docstring). ``uploads``
    (``heterog.compiler.offload.shard_uploads``): the copies up of shards held on the host, which the gather
    then waits for instead of the resident shards, and the readers on each device too (the shard's buffer
    lives until they have run).

    ``recompute`` (the plan's recomputed ops, ``op_group`` and each group's first backward op that reads a
    recomputed value, ``heterog.compiler.place.first_recomputed_reads``): a recomputed forward reader reads the
    parameter again in backward, from the backward gather (made for it where no backward op reads the
    parameter) and lands before the recomputation, as FSDP's pre-backward hook gathers before activation
    checkpointing recomputes: it waits for the ops two hops before the first of the parameter's backward
    readers and of its readers' groups' first backward ops that read a recomputed value.
    ``prov.again`` maps each forward landing (and copy up) to its backward one."""
    gi, si = ctx.index, state_index(ctx)
    n_ops, m = gi.n_ops, ctx.n_devices
    phase = ctx.graph.phase_index
    groups: dict[tuple[int, int], list[int]] = {}
    for e in edges.tolist():
        groups.setdefault((int(gi.e_src[e]), int(phase[gi.e_dst[e]])), []).append(e)
    again: dict[int, np.ndarray] = {}                # parameter -> its recomputed forward readers
    op_group = first_back = np.zeros(0, dtype=np.int64)
    if recompute is not None:
        rc, op_group, first_back = recompute
        for (p, ph), es in list(groups.items()):
            x = np.unique(gi.e_dst[np.array(es, dtype=np.int64)])
            x = x[rc[x]] if ph == 0 else x[:0]
            if len(x):
                again[p] = x
                groups.setdefault((p, 1), [])
    landed: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}    # (p, phase) -> landings, copies up
    for (p, ph), es in sorted(groups.items()):
        t = int(si.param_tensor[p])
        owner = n_ops + t
        devs = layouts.unique_devices(int(op_lay[p]))
        frac = state.frac[state.frac_row(p)]
        nbytes = float(si.param_bytes[p])
        readers = np.array(sorted({int(gi.e_dst[e]) for e in es}), dtype=np.int64)
        sub = 2 * ph                                    # phase 0: subs 0-1, phase 1: 2-3 (distinct order keys)
        trig_ops = np.array(si.trigger[ph].get(p, ()), dtype=np.int64)
        placed, first = readers, int(readers[0]) if len(readers) else n_ops
        if ph == 1 and p in again:                      # read again by recomputed instances before backward
            placed = np.union1d(readers, again[p])
            first = min(first, int(first_back[op_group[again[p]]].min()))
            trig_ops = np.array(sorted(si.before(first)), dtype=np.int64)
        sync = conv.trigger(prov.inst_start[trig_ops], op=p, tensor=t,
                            prio_op=first, stage="split", cls=1, sub=sub, owner=owner)
        ups = uploads(ctx, conv, state, p, ph, devs, np.array([sync]), first, owner) if uploads is not None else None
        shards = prov.inst_start[p] + layouts.last_entries(int(op_lay[p])) if ups is None else ups
        ag = int(conv.collective(GATHER, devs, nbytes, np.concatenate([[sync], shards])[None, :], op=p, tensor=t,
                                 prio_op=first, stage="split", cls=1,
                                 sub=sub + 1 if ups is None else UPLOAD_SUB + 2 * m + ph, owner=owner,
                                 have=frac[list(devs)])[0])
        # where the readers run: landings on the config's devices, transfers to the others
        need = np.array(sorted({d for k in set(op_lay[placed].tolist()) for d in layouts.devices[k]}),
                        dtype=np.int64)
        inside = np.array([d in devs for d in need.tolist()], dtype=bool)
        land_at = np.full(m, -1, dtype=np.int64)
        d_in, d_out = need[inside], need[~inside]
        if len(d_in):
            land_at[d_in] = conv.land(ag, d_in, nbytes, np.ones(len(d_in)), op=p, tensor=t, prio_op=first, cls=1,
                                      owner=owner, sub=ph * m + d_in)
        if len(d_out):
            land_at[d_out] = conv.transfers(np.full(len(d_out), ag), np.full(len(d_out), devs[0], dtype=np.int64),
                                            d_out, np.full(len(d_out), nbytes), op=p, prio_op=first,
                                            stage="transfer", cls=1, tensor=t, sub=ph * m + d_out, owner=owner)
        up_at = np.full(m, -1, dtype=np.int64)
        if ups is not None:
            up_at[list(devs)] = ups
        landed[(p, ph)] = (land_at, up_at)
        if ph == 1 and p in again:                      # the forward landings and copies up -> these
            f_land, f_up = landed[(p, 0)]
            for before, now in ((f_land, land_at), (f_up, up_at)):
                on = (before >= 0) & (now >= 0)
                prov.again.update(zip(before[on].tolist(), now[on].tolist()))
        for v in readers.tolist():
            k = int(op_lay[v])
            dv = layouts.dev_flat[layouts.ptr[k]:layouts.ptr[k + 1]]
            conv.deps(prov.inst_start[v] + np.arange(len(dv)), land_at[dv], owner)
            held = up_at[dv] >= 0
            if held.any():
                conv.deps(prov.inst_start[v] + np.nonzero(held)[0], up_at[dv[held]], owner)
