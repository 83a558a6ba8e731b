"""Host-side costs of offloading (ZeRO-Offload): GPU<->host transfers, the optimizer step on the host CPU,
and the host memory a plan's offloaded state needs per server, checked against the servers' hosts.

A server's host (``heterog.cluster.topology.Host``, a cluster file's ``host:`` entry) has ``sockets`` CPUs
of one catalog type and ``memory_bytes``; each GPU reaches it over its own link (PCIe x16, or NVLink-C2C
on a GH200). A server without a host record cannot offload: its host memory counts as 0 bytes and
pricing a transfer or step on it raises ``ClusterError``.

Transfer of ``x`` bytes between a GPU and its host, ``k`` GPUs of the server transferring at once::

    t = pcie_latency + x / min(pcie_bandwidth, B_host / k)        B_host = sockets * bw_socket * me

Assumption (stated, not measured): each GPU has its own x16 link to the root complex (no PCIe switch
shared by two GPUs, as in a dual-socket server with one GPU per root port and in a GH200), so the links do
not contend; what the ``k`` concurrent transfers share is the host memory they read or write
(``B_host``: peak host memory bandwidth of all sockets times the CPU's memory efficiency).

Optimizer step on the host, ``n`` parameters per GPU, ``g`` GPUs' processes stepping at once on the
server's host (all its cores and memory shared; each process's state on its own socket)::

    t = max(g * n * step_bytes / B_host,  g * n * step_flops / F_host)    F_host = sockets * peak_socket * ce

(a roofline: the step streams its state once and is bound by memory on every catalog CPU). Per parameter
(``OPTIMIZERS``), with fp32 master weights and states on the host (DeepSpeed's CPU-Adam, ZeRO-Offload):

- ``adam`` (AdamW): reads param, grad, m, v and writes param, m, v, 4 bytes each: 28 bytes; FLOPs:
  m = b1 m + (1 - b1) g (3), v = b2 v + (1 - b2) g^2 (4), denominator sqrt(v) * c2 + eps (3),
  p -= s * m / denominator (3), decoupled decay p *= 1 - lr wd (1): 14. Host state: param, grad, m, v
  (DeepSpeed keeps an fp32 gradient partition in pinned host memory): 16 bytes.
- ``sgd`` (with momentum): reads param, grad, buf and writes param, buf: 20 bytes; buf = mu buf + g (2),
  p -= lr buf (2): 4 FLOPs. Host state: param, grad, buf: 12 bytes.

Host memory needed by a server: the sum over its GPUs of (offloaded parameters x state bytes per
parameter). Only the state is counted, not the framework's own use or pinned staging buffers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from heterog.cluster.topology import Cluster, Host
from heterog.errors import ClusterError, StrategyError


@dataclass(frozen=True)
class OptimizerTraffic:
    """What one optimizer step costs the host per parameter (module docstring)."""

    name: str
    step_bytes_per_param: int       # host memory read + written by one step
    step_flops_per_param: int       # fp32 FLOPs of one step
    state_bytes_per_param: int      # host memory held per offloaded parameter


OPTIMIZERS: dict[str, OptimizerTraffic] = {
    "adam": OptimizerTraffic("adam", step_bytes_per_param=28, step_flops_per_param=14, state_bytes_per_param=16),
    "sgd": OptimizerTraffic("sgd", step_bytes_per_param=20, step_flops_per_param=4, state_bytes_per_param=12),
}


class HostMemoryError(StrategyError):
    """A plan's offloaded state does not fit a server's host memory (or the server has no host)."""


def optimizer_traffic(optimizer: str) -> OptimizerTraffic:
    """The ``OPTIMIZERS`` entry of ``optimizer``; StrategyError naming it and the known ones if absent."""
    if optimizer not in OPTIMIZERS:
        raise StrategyError(f"unknown optimizer {optimizer!r} for a host step; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[optimizer]


def _server_host(cluster: Cluster, server: int) -> Host:
    if not 0 <= int(server) < len(cluster.servers):
        raise ClusterError(f"cluster {cluster.name!r}: no server {server}; servers are 0..{len(cluster.servers) - 1}")
    s = cluster.servers[int(server)]
    if s.host is None:
        raise ClusterError(f"cluster {cluster.name!r}: server {s.name!r} has no 'host:' entry; nothing can be "
                           f"offloaded to it")
    return s.host


def _at_least_one(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise StrategyError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def pcie_time_s(cluster: Cluster, device: int, nbytes: float, n_concurrent: int = 1) -> float:
    """Seconds to move ``nbytes`` between GPU ``device`` and its server's host while ``n_concurrent`` GPUs of
    that server transfer at once (this one included): ``latency + nbytes / min(pcie, B_host / k)``; 0 for
    no bytes. ClusterError if the server has no host."""
    host = cluster.host_of(device)
    k = _at_least_one(n_concurrent, "n_concurrent")
    if not nbytes >= 0:
        raise StrategyError(f"a host transfer of {nbytes!r} bytes; the size must be >= 0")
    if nbytes == 0:
        return 0.0
    return host.pcie_latency_s + nbytes / min(host.pcie_bandwidth_Bps, host.effective_memory_Bps / k)


def host_optimizer_step_s(cluster: Cluster, server: int, n_params: float, optimizer: str = "adam",
                          n_gpus_sharing: int = 1) -> float:
    """Seconds of one optimizer step on server ``server``'s host CPUs for ``n_params`` parameters of each of
    ``n_gpus_sharing`` GPUs stepping at once: the roofline maximum of the memory traffic over the host's
    effective memory bandwidth and the FLOPs over its effective FLOP/s (module docstring)."""
    host = _server_host(cluster, server)
    g = _at_least_one(n_gpus_sharing, "n_gpus_sharing")
    if not n_params >= 0:
        raise StrategyError(f"a host optimizer step of {n_params!r} parameters; the count must be >= 0")
    traffic = optimizer_traffic(optimizer)
    total = g * float(n_params)
    return max(total * traffic.step_bytes_per_param / host.effective_memory_Bps,
               total * traffic.step_flops_per_param / host.effective_flops)


def host_memory_need_bytes(cluster: Cluster, offloaded_params: Sequence[float] | np.ndarray,
                           optimizer: str = "adam") -> np.ndarray:
    """(servers,) host memory the offloaded state needs on each server: the sum over its GPUs of
    ``offloaded_params[device] * state_bytes_per_param``. ``offloaded_params`` is (M,), per device."""
    params = np.asarray(offloaded_params, dtype=np.float64)
    if params.shape != (cluster.n_devices,):
        raise StrategyError(f"offloaded parameters have shape {params.shape}; the cluster has "
                            f"{cluster.n_devices} devices")
    if not (params >= 0).all():
        raise StrategyError("offloaded parameter counts must be >= 0")
    per_device = params * optimizer_traffic(optimizer).state_bytes_per_param
    return np.bincount(cluster.server_of, weights=per_device, minlength=len(cluster.servers))


def host_oom_servers(cluster: Cluster, need_bytes: Sequence[float] | np.ndarray) -> list[int]:
    """Indices of the servers whose host memory (0 without a host record) is below ``need_bytes``."""
    need = np.asarray(need_bytes, dtype=np.float64)
    if need.shape != (len(cluster.servers),):
        raise StrategyError(f"host memory needs have shape {need.shape}; the cluster has "
                            f"{len(cluster.servers)} servers")
    return [j for j in range(len(cluster.servers)) if need[j] > cluster.host_memory_bytes(j)]


def check_host_memory(cluster: Cluster, need_bytes: Sequence[float] | np.ndarray) -> None:
    """Raise HostMemoryError naming the first server whose host cannot hold ``need_bytes`` (its need and
    its memory, or that it has no host)."""
    over = host_oom_servers(cluster, need_bytes)
    if not over:
        return
    j = over[0]
    s, need = cluster.servers[j], float(np.asarray(need_bytes, dtype=np.float64)[j])
    more = f" (and {len(over) - 1} more server(s))" if len(over) > 1 else ""
    if s.host is None:
        raise HostMemoryError(f"cluster {cluster.name!r}: server {s.name!r} has no 'host:' entry but the plan "
                              f"offloads {need / 1e9:.3g} GB to it{more}")
    raise HostMemoryError(f"cluster {cluster.name!r}: server {s.name!r} needs {need / 1e9:.3g} GB of host memory "
                          f"for offloaded state, it has {s.host.memory_bytes / 1e9:.3g} GB{more}")


__all__ = ["OPTIMIZERS", "HostMemoryError", "OptimizerTraffic", "check_host_memory", "host_memory_need_bytes",
           "host_oom_servers", "host_optimizer_step_s", "optimizer_traffic", "pcie_time_s"]
