"""What writing a checkpoint costs under a plan: the bytes each device writes and the time the writes take
at the storage bandwidth of each server (``Server.storage_bandwidth_Bps``), as the runtime writes them
(``heterog.runtime.checkpoint``: each rank writes the parts it holds, one holder a value held whole).

Bytes: a parameter with its optimizer state, and a buffer. A value held whole by several devices is
written once, by the first of them; a value divided beyond the batch, by each device its share; sharded
optimizer state (and parameters at stage 3) by each device its part (``StatePlacement.frac``).

Time: the devices of a server share its storage, so a server's writes take its devices' bytes over its
storage bandwidth; the servers write in parallel and the checkpoint takes as long as the slowest. Training
waits for it (a synchronous save). Written every ``K`` steps it adds ``time / K`` to an iteration, the term
``Evaluator(checkpoint_every_steps=K)`` adds to the simulated iteration time. Device memory is unchanged:
the save copies one tensor at a time from where it lives to the host and on to storage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.compiler import CompiledPlan
    from heterog.graph.opgraph import OpGraph


def checkpoint_bytes(graph: OpGraph, cluster: Cluster, plan: CompiledPlan) -> np.ndarray:
    """(M,) bytes each device writes to a checkpoint of ``plan`` (module docstring)."""
    pl = plan.placements
    state = pl.state
    out = np.zeros(cluster.n_devices)
    for o, op in enumerate(graph.ops):
        if op.kind not in ("param", "buffer") or op.target == "get_attr":
            continue
        lay = pl.layouts[int(pl.op_layout[o])]
        shares = dict(zip(lay.devices, lay.split))
        devs = sorted(shares)
        if any(s < 1.0 for s in shares.values()):             # divided beyond the batch: each its share
            for d, s in shares.items():
                out[d] += (op.param_bytes + op.state_bytes) * s
            continue
        stage = int(state.op_stage[o]) if state is not None else 0
        if stage > 0:
            assert state is not None
            frac = state.frac[int(state.frac_row(o))]
            for d in devs:
                out[d] += op.state_bytes * frac[d] + (op.param_bytes * frac[d] if stage >= 3 else 0.0)
            if stage < 3:
                out[devs[0]] += op.param_bytes
            continue
        out[devs[0]] += op.param_bytes + op.state_bytes
    return out


def checkpoint_time_s(cluster: Cluster, device_bytes: np.ndarray) -> float:
    """Seconds a checkpoint of ``device_bytes`` (M,) takes: the slowest server's bytes over its storage
    bandwidth."""
    per_server = np.bincount(cluster.server_of, weights=device_bytes, minlength=len(cluster.servers))
    bandwidth = np.array([s.storage_bandwidth_Bps for s in cluster.servers])
    return float(np.max(per_server / bandwidth))
