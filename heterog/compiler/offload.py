"""The tasks and memory of optimizer state offloaded to the host (ZeRO-Offload; ``ShardedState.offload``):
gradients down over PCIe, the optimizer step on the host CPU, updated parameters back up.

Semantics: docs/design.md, "Offloading". For a parameter whose update ops lie in an offloading group, on
each device d of the group (holding the fraction f_d of the state: its shard, or 1 without sharding):

- *down*: every whole tensor the update ops read from the GPU (the gradient: all-reduced, its shard after a
  reduce-scatter, or the device's own) is copied to the host once its value is final, f_d of its bytes: a
  TRANSFER on d's GPU->host link (``pcie-down``), ``heterog.cost.host.pcie_time_s`` with k = the group's
  devices on d's server (its replicas transfer the same layer at the same time); scalars (step counters,
  bias corrections) cost a dependency only.
- *step*: the update ops over whole tensors run on the server's host CPU (one resource per server, so the
  steps of its GPUs run one after another: g steps of n parameters end after ``host_optimizer_step_s(n, g)``,
  the formula's g-way sharing in total), the parameter's step ``host_optimizer_step_s(f_d * numel)``
  apportioned to its update ops by their memory traffic; they allocate nothing on the GPU.
- *up*: the updated parameter (f_d of it) is copied host->GPU after the op writing it (a TRANSFER on
  ``pcie-up``) into the resident parameter; a stage 1-2 all-gather of it waits for the copies.

Offloaded parameters (``offload="parameters"``, stage 3): no copy up follows the step; before each stage-3
all-gather each device copies its shard up (``shard_uploads``), allocated until the phase's readers have run.

Memory: the GPU no longer holds the parameter's optimizer state (``Op.state_bytes``), nor, with offloaded
parameters, its shard of the parameter; its server's host holds
``host_memory_need_bytes`` (fp32 master parameter, gradient and moments) of f_d of the parameter's elements
per device: resident bytes of the server's host CPU resource, whose capacity is the host's memory, so a
plan beyond it is out of memory. Host resources exist only in plans that offload (others keep theirs).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.caches import DerivedCache
from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine
from heterog.compiler.registries import LayoutTable
from heterog.compiler.sharded_state import OFFLOAD_CODES, UPLOAD_SUB, StatePlacement, state_index
from heterog.compiler.tasks import Providers, ragged
from heterog.cost.host import host_memory_need_bytes, host_optimizer_step_s, optimizer_traffic
from heterog.errors import StrategyError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import ParallelConfig
    from simulator.taskgraph import TaskGraph

# the host step of a graph's optimizer (``heterog.graph.optimizer``): plain and momentum SGD step as SGD
HOST_OPTIMIZER = {"adam": "adam", "momentum": "sgd", "sgd": "sgd"}


@dataclass(frozen=True)
class OffloadIndex:
    """What the graph fixes for offloading (kept per graph): ``param_of`` (n_ops,) the param placeholder an
    op serves (-1: none); ``numel`` (n_ops,) a param placeholder's elements; ``step_share`` (n_ops,) an
    update op's part of its parameter's host step (its memory traffic over that of the parameter's update ops
    over whole tensors); ``whole`` (n_ops,) the op's output has more than one element."""

    param_of: np.ndarray
    numel: np.ndarray
    step_share: np.ndarray
    whole: np.ndarray


_OFFLOAD_INDEX: DerivedCache[OpGraph, OffloadIndex] = DerivedCache("OffloadIndex of each graph")


def offload_index(ctx: CompileContext) -> OffloadIndex:
    """The graph's ``OffloadIndex`` (kept per graph)."""
    return _OFFLOAD_INDEX.get(ctx.graph, lambda: _build_offload_index(ctx))


def _build_offload_index(ctx: CompileContext) -> OffloadIndex:
    ops, si = ctx.graph.ops, state_index(ctx)
    n = len(ops)
    params = {op.param: i for i, op in enumerate(ops) if op.kind == "param"}
    param_of = np.array([params.get(op.param, -1) if op.param is not None else -1 for op in ops], dtype=np.int64)
    whole = np.array([bool(op.output_shapes) and int(np.prod(op.output_shapes[0])) > 1 for op in ops], dtype=bool)
    numel = np.array([float(np.prod(op.output_shapes[0])) if op.kind == "param" and op.output_shapes else 0.0
                      for op in ops])
    traffic = np.array([float(op.bytes_read + op.bytes_written) for op in ops])
    host = si.scaled_update & (param_of >= 0)
    total = np.bincount(param_of[host], weights=traffic[host], minlength=n)
    count = np.bincount(param_of[host], minlength=n).astype(np.float64)
    share = np.zeros(n)
    p = param_of[host]
    share[host] = np.where(total[p] > 0, traffic[host] / np.where(total[p] > 0, total[p], 1.0), 1.0 / count[p])
    return OffloadIndex(param_of, numel, share, whole)


@dataclass(frozen=True)
class HostTable:
    """The cluster's host side as compiler resources (kept per context): ``first`` the first host
    resource id; device d's GPU->host link is ``first + d``, its host->GPU link ``first + M + d``, server s's
    host CPU ``first + 2M + s``; ``resources`` the context's resources with these added (the CPUs' memory
    capacity: their host's memory, 0 without a host); ``step_s_per_param`` (servers,) seconds of one
    parameter's optimizer step on each host (0 without a host)."""

    first: int
    resources: TaskGraph
    step_s_per_param: np.ndarray


_HOST_TABLE: DerivedCache[CompileContext, HostTable] = DerivedCache("HostTable of each compile context")


def host_table(ctx: CompileContext) -> HostTable:
    """The context's ``HostTable`` (kept per context)."""
    return _HOST_TABLE.get(ctx, lambda: _build_host_table(ctx.resources, ctx.cluster, ctx.graph.optimizer))


def _build_host_table(base: TaskGraph, cluster: Cluster, optimizer: str) -> HostTable:
    tg = base.empty_copy()
    first = tg.n_resources
    names = cluster.device_names
    for direction in ("down", "up"):
        for name in names:
            tg.add_resource(f"pcie-{direction}:{name}")
    opt = host_optimizer(optimizer)
    step = np.zeros(len(cluster.servers))
    for j, s in enumerate(cluster.servers):
        tg.add_resource(f"host:{s.name}", memory_capacity_bytes=float(cluster.host_memory_bytes(j)))
        if s.host is not None:
            step[j] = host_optimizer_step_s(cluster, j, 1.0, opt)
    return HostTable(first, tg, step)


def host_optimizer(graph_optimizer: str) -> str:
    """The host step (``heterog.cost.host.OPTIMIZERS``) of a graph captured with ``graph_optimizer``."""
    return optimizer_traffic(HOST_OPTIMIZER.get(graph_optimizer, graph_optimizer)).name


def check_offloading(cluster: Cluster, group_configs: Sequence[ParallelConfig]) -> None:
    """StrategyError naming the group and server when an offloading group has a device on a server without
    a ``host:`` entry."""
    for g, cfg in enumerate(group_configs):
        if cfg.sharded is None or not cfg.sharded.offloads:
            continue
        for d in cfg.devices:
            s = cluster.servers[int(cluster.server_of[d])]
            if s.host is None:
                raise StrategyError(f"group {g} offloads state from device {cluster.devices[d].name!r} to the host "
                                    f"of server {s.name!r}, which has no 'host:' entry in cluster {cluster.name!r}")


def offloads(state: StatePlacement | None) -> bool:
    """Whether a plan placed with ``state`` offloads anything (and so has host resources)."""
    return state is not None and bool(np.any(state.op_offload > 0))


def _concurrent(ctx: CompileContext, state: StatePlacement, rows: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """(len(dev),) the devices of config row ``rows[i]`` on ``dev[i]``'s server (those transferring at once)."""
    so = ctx.cluster.server_of
    out = np.empty(len(dev), dtype=np.int64)
    for r in np.unique(rows).tolist():
        at = rows == r
        out[at] = np.bincount(so[list(state.devices[r])], minlength=len(ctx.cluster.servers))[so[dev[at]]]
    return out


# ----------------------------------------------------------------------------------- the step
def on_host(ctx: CompileContext, state: StatePlacement | None, ops: np.ndarray) -> np.ndarray:
    """(len(ops),) the update ops among ``ops`` that run on the host CPU."""
    if state is None:
        return np.zeros(len(ops), dtype=bool)
    return (state.op_offload[ops] > 0) & state_index(ctx).scaled_update[ops] & (offload_index(ctx).param_of[ops] >= 0)


def host_instances(ctx: CompileContext, state: StatePlacement, inst_op: np.ndarray, inst_dev: np.ndarray,
                   dur: np.ndarray, alloc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Instances' (dur, alloc, resource) with the host-run update ops' at their part of the parameter's host
    step, allocating nothing on the GPU, on their server's host CPU (the others: their device)."""
    res = inst_dev.copy()
    host = on_host(ctx, state, inst_op)
    if not host.any():
        return dur, alloc, res
    oi, ht = offload_index(ctx), host_table(ctx)
    o, d = inst_op[host], inst_dev[host]
    p = oi.param_of[o]
    f = state.frac[state.frac_row(o), d]
    server = ctx.cluster.server_of[d]
    dur, alloc = dur.copy(), alloc.copy()
    dur[host] = ht.step_s_per_param[server] * oi.numel[p] * f * oi.step_share[o]
    alloc[host] = 0.0
    res[host] = ht.first + 2 * ctx.n_devices + server
    return dur, alloc, res


def emit_uploads(ctx: CompileContext, layouts: LayoutTable, conv: Engine, ops: np.ndarray,
                 op_lay: np.ndarray, state: StatePlacement, prov: Providers) -> dict[int, np.ndarray]:
    """After each host-run op among ``ops`` that writes a parameter's next value, the copy of the device's
    part of the parameter to each device (its last entries); writer op -> those copies, in that order."""
    si, ht = state_index(ctx), host_table(ctx)
    host = ops[on_host(ctx, state, ops)]
    host = host[state.op_offload[host] != OFFLOAD_CODES["parameters"]]     # offloaded parameters stay on the host
    out: dict[int, np.ndarray] = {}
    for o in host[si.new_param[host] >= 0].tolist():
        p, lay = int(si.new_param[o]), int(op_lay[o])
        last = layouts.last_entries(lay)
        dev = layouts.dev_flat[layouts.ptr[lay] + last]
        row, part = int(state.op_row[o]), state.frac[state.frac_row(o), dev]
        out[o] = conv.host_copies(prov.inst_start[o] + last, dev, si.param_bytes[p] * part,
                                  _concurrent(ctx, state, np.full(len(dev), row), dev), ht.first + ctx.n_devices + dev,
                                  op=o, prio_op=o, stage="push", cls=0, tensor=int(si.param_tensor[p]), sub=dev,
                                  owner=o)
    return out


# ----------------------------------------------------------------------------------- offloaded parameters
def shard_uploads(ctx: CompileContext, conv: Engine, state: StatePlacement, p: int, ph: int,
                  devs: tuple[int, ...], after: np.ndarray, prio_op: int, owner: int) -> np.ndarray | None:
    """Stage 3 with offloaded parameters: before the all-gather of parameter ``p`` for phase ``ph`` (0 forward,
    1 backward), each device of ``devs`` copies its shard of the parameter up from its host (f_d of its bytes
    on its ``pcie-up`` link, allocated there until the phase's readers have run; the engine's ``host_copies``),
    after the tasks ``after`` (the gather's trigger); the copies in ``devs``' order, or None where ``p``'s
    parameters are on the GPUs."""
    if state.op_offload[p] != OFFLOAD_CODES["parameters"]:
        return None
    si, ht = state_index(ctx), host_table(ctx)
    row, dev = int(state.op_row[p]), np.array(devs, dtype=np.int64)
    nbytes = si.param_bytes[p] * state.frac[state.frac_row(p), dev]
    k = len(dev)
    up = conv.host_copies(np.full(k, -1, dtype=np.int64), dev, nbytes,
                          _concurrent(ctx, state, np.full(k, row), dev), ht.first + ctx.n_devices + dev, op=p,
                          prio_op=prio_op, stage="split", cls=1, tensor=int(si.param_tensor[p]),
                          sub=UPLOAD_SUB + ph * ctx.n_devices + dev, owner=owner, alloc=nbytes)
    if len(after):
        conv.deps(np.repeat(up, len(after)), np.tile(after, len(up)), owner)
    return up


# ----------------------------------------------------------------------------------- copies down
def host_read_edges(ctx: CompileContext, state: StatePlacement | None, edges: np.ndarray) -> np.ndarray:
    """(len(edges),) the edges that bring a whole tensor from the GPU to a host-run op: the producer is
    neither host-run nor a placeholder (parameters and their state are on the host)."""
    if state is None:
        return np.zeros(len(edges), dtype=bool)
    gi = ctx.index
    src, dst = gi.e_src[edges], gi.e_dst[edges]
    return on_host(ctx, state, dst) & ~on_host(ctx, state, src) & gi.is_compute[src] & offload_index(ctx).whole[src]


def connect_host_reads(ctx: CompileContext, layouts: LayoutTable, conv: Engine, edges: np.ndarray,
                       op_lay: np.ndarray, state: StatePlacement, prov: Providers) -> None:
    """One copy down per (tensor, device) of ``edges``' readers, f_d of its bytes, once the value is final on
    that device (or, where it is not, on the first device holding it); the readers there wait for it. The
    edges' own dependencies (and any transfer between devices) are emitted as for any edge."""
    gi, ht, n_ops, m = ctx.index, host_table(ctx), ctx.index.n_ops, ctx.n_devices
    rows, loc = ragged(layouts.length[op_lay[gi.e_dst[edges]]])
    er = edges[rows]
    v, t = gi.e_dst[er], gi.e_tensor[er]
    d = layouts.dev_flat[layouts.ptr[op_lay[v]] + loc]
    uniq, first_idx, inv = np.unique(t * m + d, return_index=True, return_inverse=True)
    first_reader = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first_reader, inv, v)
    tt, td, tv = t[first_idx], d[first_idx], v[first_idx]
    row = state.op_row[tv]
    have = prov.at[tt, td]
    miss = have < 0
    if miss.any():
        holder = layouts.dev_flat[layouts.ptr[prov.layout[tt[miss]]]]
        have[miss] = prov.at[tt[miss], holder]
    part = state.frac[state.frac_row(tv), td]
    down = conv.host_copies(have, td, gi.t_bytes[tt] * part, _concurrent(ctx, state, row, td),
                            ht.first + td, op=gi.t_op[tt], prio_op=first_reader, stage="transfer", cls=1, tensor=tt,
                            sub=td, owner=n_ops + tt)
    conv.deps(prov.inst_start[v] + loc, down[inv], n_ops + t)


# ----------------------------------------------------------------------------------- memory
def offloaded_memory(ctx: CompileContext, layouts: LayoutTable, op_lay: np.ndarray,
                     state: StatePlacement) -> tuple[np.ndarray, np.ndarray]:
    """((M,) resident bytes each device no longer holds, (servers,) bytes its host holds): of each
    parameter of an offloading group, f_d of its optimizer state leaves device d (the rest is sharded away),
    f_d of the parameter too where the parameters are offloaded (its master copy on the host is the one
    kept), and ``host_memory_need_bytes`` of f_d of its elements go to d's server's host."""
    si, oi = state_index(ctx), offload_index(ctx)
    saved = np.zeros(ctx.n_devices)
    elements = np.zeros(ctx.n_devices)
    for p in np.nonzero((state.op_offload > 0) & (si.param_tensor >= 0) & (oi.numel > 0))[0].tolist():
        devs = np.array(layouts.unique_devices(int(op_lay[p])), dtype=np.int64)
        f = state.frac[state.frac_row(p), devs]
        gone = si.state_bytes[p] + (si.param_bytes[p] if state.op_offload[p] == OFFLOAD_CODES["parameters"] else 0.0)
        saved[devs] += gone * f
        elements[devs] += oi.numel[p] * f
    return saved, host_memory_need_bytes(ctx.cluster, elements, host_optimizer(ctx.graph.optimizer))


def host_resources(ctx: CompileContext, device_resident: np.ndarray, host_bytes: np.ndarray) -> TaskGraph:
    """An empty TaskGraph of the context's resources and the host ones, ``device_resident`` (the context's
    resources) and ``host_bytes`` (servers,) on the host CPUs resident."""
    ht = host_table(ctx)
    resident = np.zeros(ht.resources.n_resources)
    resident[:len(device_resident)] = device_resident
    resident[ht.first + 2 * ctx.n_devices:] = host_bytes
    return ht.resources.empty_copy(resident_bytes=resident)


def host_peaks(ctx: CompileContext, state: StatePlacement | None, peak_memory: np.ndarray) -> dict[str, float]:
    """Server name -> the most its host memory held in a simulation of a plan placed with ``state``
    (``peak_memory`` per resource); empty for a plan that offloads nothing."""
    if not offloads(state):
        return {}
    first = host_table(ctx).first + 2 * ctx.n_devices
    return {s.name: float(peak_memory[first + j]) for j, s in enumerate(ctx.cluster.servers)}
