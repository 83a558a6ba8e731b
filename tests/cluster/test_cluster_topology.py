"""Topology: path tables and bottlenecks on paper-12gpu by hand, derived quantities, validation."""
import math

import numpy as np
import pytest

from heterog.cluster import CATALOG, Cluster, Device, Link, Server, load_cluster
from heterog.cluster.topology import build_links
from heterog.errors import ClusterError


def two_servers(nic_Bps=(10e9, 10e9), intra_Bps=100e9, switch_Bps=math.inf) -> Cluster:
    t = CATALOG["V100-16GB"]
    devices = [Device(i, f"s{i // 2}/gpu{i % 2}", t, i // 2) for i in range(4)]
    servers = [Server(j, f"s{j}", [2 * j, 2 * j + 1], "nvlink", intra_Bps, 1e-6, nic_Bps[j], 5e-6)
               for j in range(2)]
    return Cluster("two", devices, [], servers, switch_Bps)


def test_paper12_paths_bandwidth_latency_by_hand():
    c = load_cluster("paper-12gpu")
    assert c.n_devices == 12 and len(c.servers) == 5 and c.n_links == 30
    # v100 server: devices 0-3, intra links 0..11 then nic-out 12, nic-in 13; gtx0: devices 4-5,
    # intra links 14-15, nic-out 16, nic-in 17.
    assert c.path(0, 1) == (0,) and c.links[0].name == "v100/gpu0->v100/gpu1" and c.links[0].kind == "nvlink"
    assert c.bandwidth_Bps[0, 1] == 45e9 and c.latency_s[0, 1] == pytest.approx(2e-6)
    assert c.path(4, 5) == (14,) and c.bandwidth_Bps[4, 5] == 12e9 and c.latency_s[4, 5] == pytest.approx(5e-6)
    # V100 -> 1080Ti: nic-out of v100 (100 GbE), nic-in of gtx0 (50 GbE), switch 100 Gbit/s
    assert c.path(0, 4) == (12, 17)
    assert [c.links[k].name for k in c.path(0, 4)] == ["v100/nic-out", "gtx0/nic-in"]
    assert c.bandwidth_Bps[0, 4] == min(100e9 / 8, 50e9 / 8, 100e9 / 8) == 6.25e9
    assert c.latency_s[0, 4] == pytest.approx(10e-6 + 10e-6)
    assert c.path(4, 0) == (16, 13) and c.bandwidth_Bps[4, 0] == 6.25e9
    assert c.path(3, 3) == () and c.bandwidth_Bps[3, 3] == math.inf and c.latency_s[3, 3] == 0.0
    assert list(c.path_table[0, 4]) == [12, 17] and list(c.path_table[0, 1]) == [0, -1]


def test_switch_caps_cross_server_bandwidth():
    c = two_servers(nic_Bps=(10e9, 10e9), switch_Bps=4e9)
    assert c.bandwidth_Bps[0, 2] == 4e9 and c.bandwidth_Bps[0, 1] == 100e9


def test_derived_arrays_and_names():
    c = load_cluster("paper-8gpu")
    assert c.power.tolist() == [15.7e12] * 2 + [11.34e12] * 4 + [9.3e12] * 2
    assert c.server_of.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert c.memory_bytes[0] == 16 * 2**30 and c.memory_bytes[2] == 11 * 2**30
    assert c.device_names[:3] == ["s0/gpu0", "s0/gpu1", "s1/gpu0"]
    assert c.link_names[2:4] == ["s0/nic-out", "s0/nic-in"]
    assert np.all(np.diag(c.bandwidth_Bps) == np.inf)


def test_given_links_may_be_degraded_but_must_match():
    c = two_servers()
    links = [Link(k.index, k.name, 1e9 if k.index == 0 else k.bandwidth_Bps, k.latency_s, k.kind)
             for k in build_links(c.servers, c.devices)]
    degraded = Cluster("two", c.devices, links, c.servers)
    assert degraded.bandwidth_Bps[0, 1] == 1e9 and degraded.bandwidth_Bps[1, 0] == 100e9
    with pytest.raises(ClusterError, match="do not match"):
        Cluster("two", c.devices, links[:-1], c.servers)
    bad = [Link(0, links[0].name, 0.0, 0.0, links[0].kind)] + links[1:]
    with pytest.raises(ClusterError, match=r"link 's0/gpu0->s0/gpu1' has non-positive bandwidth 0.0"):
        Cluster("two", c.devices, bad, c.servers)


def test_disconnected_cluster_names_servers():
    with pytest.raises(ClusterError, match=r"disconnected: servers s1 have no NIC"):
        two_servers(nic_Bps=(10e9, 0.0))
    with pytest.raises(ClusterError, match=r"disconnected: servers s0, s1"):
        two_servers(nic_Bps=(0.0, 0.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"intra_Bps": 0.0}, r"server 's0' has non-positive intra bandwidth 0.0"),
    ({"intra_Bps": -3.0}, r"server 's0' has non-positive intra bandwidth -3.0"),
    ({"nic_Bps": (-1.0, 10e9)}, r"server 's0' has non-positive NIC bandwidth -1.0"),
    ({"switch_Bps": 0.0}, r"switch bandwidth must be positive, got 0.0"),
])
def test_non_positive_bandwidth_names_the_thing(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        two_servers(**kwargs)


def test_bad_slowdown_and_membership():
    c = two_servers()
    devices = list(c.devices)
    devices[1] = Device(1, "s0/gpu1", devices[1].type, 0, slowdown=0.0)
    with pytest.raises(ClusterError, match=r"device 's0/gpu1' has slowdown 0.0"):
        Cluster("two", devices, [], c.servers)
    servers = [Server(0, "s0", [0], "pcie", 1e9, 0.0, 1e9, 0.0), c.servers[1]]
    with pytest.raises(ClusterError, match=r"server 's0' lists devices \[0\]"):
        Cluster("two", c.devices, [], servers)


def test_path_of_missing_device_is_an_error():
    with pytest.raises(ClusterError, match=r"no device pair \(0, 9\)"):
        two_servers().path(0, 9)
