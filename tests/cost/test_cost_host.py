"""Host-side offloading costs (heterog.cost.host) by hand: GPU<->host transfers with a shared host memory,
the optimizer step's roofline on the host CPUs, the host memory of offloaded state and its check."""
import math

import numpy as np
import pytest

from heterog.cluster import CATALOG, Cluster, Device, Server, load_cluster
from heterog.cluster.catalog import HostCPUType
from heterog.cluster.loader import cluster_from_dict
from heterog.cluster.topology import Host
from heterog.cost.host import (
    OPTIMIZERS,
    HostMemoryError,
    check_host_memory,
    host_memory_need_bytes,
    host_oom_servers,
    host_optimizer_step_s,
    pcie_time_s,
)
from heterog.errors import ClusterError, HeterogError, StrategyError

# paper-8gpu hosts: 2x Xeon Gold 6148 -> B_host = 2 * 127.968e9 * 0.75 = 191.952e9 B/s,
# F_host = 2 * 3.072e12 * 0.5 = 3.072e12 FLOP/s; PCIe 12 GB/s, 5 us
B_PAPER = 191.952e9
F_PAPER = 3.072e12


def test_optimizer_table_counts():
    assert (OPTIMIZERS["adam"].step_bytes_per_param, OPTIMIZERS["adam"].step_flops_per_param,
            OPTIMIZERS["adam"].state_bytes_per_param) == (7 * 4, 3 + 4 + 3 + 3 + 1, 4 * 4)
    assert (OPTIMIZERS["sgd"].step_bytes_per_param, OPTIMIZERS["sgd"].step_flops_per_param,
            OPTIMIZERS["sgd"].state_bytes_per_param) == (5 * 4, 2 + 2, 3 * 4)


def test_pcie_time_is_latency_plus_bytes_over_the_own_link():
    c = load_cluster("paper-8gpu")
    assert pcie_time_s(c, 0, 12e9) == pytest.approx(5e-6 + 1.0, rel=1e-12)
    assert pcie_time_s(c, 7, 6e9, n_concurrent=2) == pytest.approx(5e-6 + 0.5, rel=1e-12)   # 95.976 GB/s each > 12
    assert pcie_time_s(c, 3, 0) == 0.0


def test_pcie_time_is_bounded_by_the_shared_host_memory():
    c = load_cluster("paper-8gpu")
    # 20 concurrent transfers: 191.952e9 / 20 = 9.5976e9 B/s < 12e9
    assert pcie_time_s(c, 0, 12e9, n_concurrent=20) == pytest.approx(5e-6 + 12e9 / 9.5976e9, rel=1e-12)
    g = load_cluster("clariden:nodes=1")
    # Grace x4: 4 * 500e9 * 0.75 = 1.5e12 B/s; alone the 450 GB/s C2C binds, four at once 375 GB/s each
    assert pcie_time_s(g, 0, 450e9) == pytest.approx(5e-6 + 1.0, rel=1e-12)
    assert pcie_time_s(g, 2, 450e9, n_concurrent=4) == pytest.approx(5e-6 + 1.2, rel=1e-12)


def test_host_step_is_memory_bound_on_catalog_cpus():
    c = load_cluster("paper-8gpu")
    assert host_optimizer_step_s(c, 0, 1e9) == pytest.approx(28e9 / B_PAPER, rel=1e-12)        # 0.14587 s
    assert 28e9 / B_PAPER > 14e9 / F_PAPER                                                    # 0.0046 s of FLOPs
    assert host_optimizer_step_s(c, 1, 1e9, n_gpus_sharing=2) == pytest.approx(2 * 28e9 / B_PAPER, rel=1e-12)
    assert host_optimizer_step_s(c, 2, 5e8, "sgd") == pytest.approx(5e8 * 20 / B_PAPER, rel=1e-12)
    assert host_optimizer_step_s(c, 3, 0) == 0.0


def test_host_step_is_flop_bound_on_a_slow_core():
    slow = HostCPUType("slow", cores=1, clock_Hz=1e9, flops_per_cycle=2, memory_bandwidth_Bps=100e9,
                       max_memory_bytes=1 << 40, source="test", compute_efficiency=1.0, memory_efficiency=1.0)
    host = Host(slow, 1, 10**11, 10e9, 0.0)
    cluster = Cluster("slow", [Device(0, "s0/gpu0", CATALOG["V100-16GB"], 0)], [],
                      [Server(0, "s0", [0], "pcie", math.inf, 0.0, host=host)])
    # memory 28e9 / 100e9 = 0.28 s; FLOPs 14e9 / 2e9 = 7 s
    assert host_optimizer_step_s(cluster, 0, 1e9) == pytest.approx(7.0, rel=1e-12)


def test_host_step_on_two_sockets():
    """A DGX-2 host (2x Xeon Platinum 8168): Adam over 1 B parameters is memory bound,
    28e9 / (2 * 127.968e9 * 0.75) = 0.146 s; the efficiencies are priors (docs/design.md)."""
    dgx2 = cluster_from_dict({"name": "dgx2", "servers": [{
        "gpus": [{"type": "V100-32GB", "count": 16}], "intra": {"kind": "nvlink", "bandwidth": "120 GB/s"},
        "host": {"cpu": "Xeon-Platinum-8168", "sockets": 2, "memory": "1.5 TB", "pcie": {"bandwidth": "12 GB/s"}}}]})
    assert host_optimizer_step_s(dgx2, 0, 1e9) == pytest.approx(28e9 / (2 * 127.968e9 * 0.75), rel=1e-12)
    assert round(host_optimizer_step_s(dgx2, 0, 1e9), 3) == 0.146


def test_host_memory_need_and_check():
    c = load_cluster("paper-8gpu")
    params = np.zeros(8)
    params[[0, 1, 6]] = [1e9, 2e9, 0.5e9]
    need = host_memory_need_bytes(c, params)
    assert need.tolist() == [48e9, 0.0, 0.0, 8e9]                     # 16 B per parameter (adam)
    assert host_memory_need_bytes(c, params, "sgd").tolist() == [36e9, 0.0, 0.0, 6e9]
    check_host_memory(c, need)
    assert host_oom_servers(c, need) == []
    params[[0, 1]] = [12e9, 13e9]                                    # 400 GB on s0 > 384 GB
    need = host_memory_need_bytes(c, params)
    assert host_oom_servers(c, need) == [0]
    with pytest.raises(HostMemoryError, match="server 's0' needs 400 GB of host memory for offloaded state, "
                                              "it has 384 GB"):
        check_host_memory(c, need)


def test_a_server_without_host_cannot_offload():
    c = load_cluster("mixed-a100-v100-t4")
    need = np.zeros(3)
    check_host_memory(c, need)                                       # nothing offloaded: fine
    need[1] = 1.0
    assert host_oom_servers(c, need) == [1]
    with pytest.raises(HostMemoryError, match="server 'v100' has no 'host:' entry but the plan offloads"):
        check_host_memory(c, need)
    with pytest.raises(ClusterError, match="server 'a100' of device 'a100/gpu0' has no 'host:' entry"):
        pcie_time_s(c, 0, 1e6)
    with pytest.raises(ClusterError, match="server 't4' has no 'host:' entry"):
        host_optimizer_step_s(c, 2, 1e6)


def test_bad_arguments_are_named():
    c = load_cluster("paper-8gpu")
    for call, message in [
        (lambda: host_optimizer_step_s(c, 0, 1e9, "lamb"),
         "unknown optimizer 'lamb' for a host step; known: adam, sgd"),
        (lambda: host_optimizer_step_s(c, 0, 1e9, n_gpus_sharing=0), "n_gpus_sharing must be a positive integer"),
        (lambda: pcie_time_s(c, 0, 1e9, n_concurrent=0), "n_concurrent must be a positive integer"),
        (lambda: pcie_time_s(c, 0, -1.0), "the size must be >= 0"),
        (lambda: host_memory_need_bytes(c, np.zeros(3)), r"shape \(3,\); the cluster has 8 devices"),
        (lambda: host_oom_servers(c, np.zeros(8)), r"shape \(8,\); the cluster has 4 servers"),
        (lambda: host_optimizer_step_s(c, 9, 1.0), "no server 9"),
    ]:
        with pytest.raises(HeterogError, match=message):
            call()
    assert issubclass(HostMemoryError, StrategyError)
