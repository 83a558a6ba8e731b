"""Host side of servers: the host CPU catalog's derived peaks by hand, the cluster file's ``host:`` entry
(validation naming the bad field, round trip), the topology's host queries, and the built-in hosts."""
import pytest

from heterog.cluster import load_cluster
from heterog.cluster.catalog import CATALOG, HOST_CATALOG, ddr_bandwidth_Bps, host_cpu_type
from heterog.cluster.generate import HOST_OF_GPU, generate_cluster, generate_cluster_dict, server_host
from heterog.cluster.loader import cluster_from_dict, cluster_to_dict, save_cluster_yaml
from heterog.errors import ClusterError

HOST = {"cpu": "Xeon-Gold-6148", "sockets": 2, "memory": "384 GB", "pcie": {"bandwidth": "12 GB/s", "latency_us": 5}}


def with_host(host: object, n_servers: int = 1) -> dict:
    servers = [{"name": f"s{j}", "gpus": ["V100-16GB"], "nic": {"bandwidth": "100 Gbit/s"}} for j in range(n_servers)]
    servers[0]["host"] = host
    return {"name": "t", "servers": servers}


# ---------------------------------------------------------------------- catalog
@pytest.mark.parametrize("name, peak_flops, memory_Bps", [
    ("Xeon-Gold-6148", 20 * 2.4e9 * 64, 6 * 2666e6 * 8),          # 3.072 TFLOP/s, 127.968 GB/s
    ("Xeon-Platinum-8168", 24 * 2.7e9 * 64, 6 * 2666e6 * 8),      # 4.1472 TFLOP/s
    ("Xeon-Gold-6248", 20 * 2.5e9 * 64, 6 * 2933e6 * 8),          # 3.2 TFLOP/s, 140.784 GB/s
    ("Xeon-Platinum-8380", 40 * 2.3e9 * 64, 8 * 3200e6 * 8),      # 5.888 TFLOP/s, 204.8 GB/s
    ("Xeon-Platinum-8480+", 56 * 2.0e9 * 64, 8 * 4800e6 * 8),     # 7.168 TFLOP/s, 307.2 GB/s
    ("EPYC-7742", 64 * 2.25e9 * 32, 8 * 3200e6 * 8),              # 4.608 TFLOP/s
    ("EPYC-7763", 64 * 2.45e9 * 32, 8 * 3200e6 * 8),              # 5.0176 TFLOP/s
    ("Grace", 72 * 3.1e9 * 32, 500e9),                            # 7.1424 TFLOP/s, datasheet 500 GB/s
])
def test_host_cpu_peaks_are_cores_clock_flops_per_cycle_and_channels_speed(name, peak_flops, memory_Bps):
    t = HOST_CATALOG[name]
    assert t.peak_flops == pytest.approx(peak_flops, rel=1e-12)
    assert t.memory_bandwidth_Bps == pytest.approx(memory_Bps, rel=1e-12)
    assert t.effective_memory_Bps == pytest.approx(memory_Bps * t.memory_efficiency, rel=1e-12)
    assert t.source


def test_ddr_bandwidth_and_lookup():
    assert ddr_bandwidth_Bps(6, 2666) == 127.968e9
    assert host_cpu_type("grace") is HOST_CATALOG["Grace"]
    with pytest.raises(ClusterError, match="unknown host CPU type 'Xeon-9999'; known: Xeon-Gold-6148"):
        host_cpu_type("Xeon-9999")


def test_the_cpu_worker_type_is_untouched():
    cpu = CATALOG["cpu"]
    assert (cpu.peak_flops, cpu.memory_bandwidth_Bps, cpu.host_driven_comm) == (0.05e12, 20e9, True)
    assert "cpu" not in HOST_CATALOG


# ---------------------------------------------------------------------- loader
def test_host_entry_is_parsed_and_round_trips(tmp_path):
    c = cluster_from_dict(with_host(HOST, 2))
    h = c.servers[0].host
    assert h is not None and c.servers[1].host is None
    assert (h.cpu.name, h.sockets, h.memory_bytes, h.pcie_bandwidth_Bps, h.pcie_latency_s) == (
        "Xeon-Gold-6148", 2, 384 * 10**9, 12e9, 5e-6)
    assert h.peak_flops == pytest.approx(2 * 3.072e12, rel=1e-12)
    assert h.effective_memory_Bps == pytest.approx(2 * 127.968e9 * 0.75, rel=1e-12)
    assert cluster_to_dict(c)["servers"][0]["host"] == {
        "cpu": "Xeon-Gold-6148", "sockets": 2, "memory": "384 GB", "pcie": {"bandwidth": "12 GB/s", "latency_us": 5}}
    assert "host" not in cluster_to_dict(c)["servers"][1]
    again = load_cluster(save_cluster_yaml(c, tmp_path / "c.yaml"))
    assert again.servers == c.servers


def test_host_defaults_one_socket_and_pcie_latency():
    c = cluster_from_dict(with_host({"cpu": "EPYC-7742", "memory": "1 TiB", "pcie": {"bandwidth": "24 GB/s"}}))
    h = c.servers[0].host
    assert h is not None and (h.sockets, h.memory_bytes, h.pcie_latency_s) == (1, 2**40, 5e-6)


@pytest.mark.parametrize("host, message", [
    ("big", r"servers\[0\]\.host: must be a mapping with cpu, memory and pcie, got 'big'"),
    ({**HOST, "ram": "1 GB"}, r"servers\[0\]\.host: unknown key\(s\) 'ram'"),
    ({k: v for k, v in HOST.items() if k != "memory"}, r"servers\[0\]\.host: 'memory' is missing"),
    ({k: v for k, v in HOST.items() if k != "pcie"}, r"servers\[0\]\.host: 'pcie' is missing"),
    ({**HOST, "cpu": "Xeon-9999"}, r"servers\[0\]\.host\.cpu: unknown host CPU type 'Xeon-9999'"),
    ({**HOST, "cpu": "V100-16GB"}, r"servers\[0\]\.host\.cpu: unknown host CPU type 'V100-16GB'"),
    ({**HOST, "sockets": 0}, r"servers\[0\]\.host\.sockets: must be a positive integer, got 0"),
    ({**HOST, "sockets": True}, r"servers\[0\]\.host\.sockets: must be a positive integer, got True"),
    ({**HOST, "memory": 384}, r"servers\[0\]\.host\.memory: memory 384 has no unit"),
    ({**HOST, "memory": "384 GX"}, r"servers\[0\]\.host\.memory: memory '384 GX' has unknown unit 'GX'"),
    ({**HOST, "memory": "-1 GB"}, r"servers\[0\]\.host\.memory: memory must be positive"),
    ({**HOST, "memory": "2 TB"}, r"servers\[0\]\.host\.memory: 2000 GB is more than 2 Xeon-Gold-6148 socket\(s\) "
                                 r"address \(1649\.27 GB\)"),
    ({**HOST, "pcie": "12 GB/s"}, r"servers\[0\]\.host\.pcie: must be a mapping with 'bandwidth'"),
    ({**HOST, "pcie": {"latency_us": 5}}, r"servers\[0\]\.host\.pcie: must be a mapping with 'bandwidth'"),
    ({**HOST, "pcie": {"bandwidth": "12 GB"}}, r"servers\[0\]\.host\.pcie\.bandwidth: bandwidth '12 GB' has "
                                                r"unknown unit 'GB'"),
    ({**HOST, "pcie": {"bandwidth": "12 GB/s", "latency_us": -1}},
     r"servers\[0\]\.host\.pcie\.latency_us: must be >= 0\.0, got -1"),
    ({**HOST, "pcie": {"bandwidth": "12 GB/s", "speed": 1}}, r"servers\[0\]\.host\.pcie: unknown key\(s\) 'speed'"),
])
def test_bad_host_entries_raise_one_line_naming_the_field(host, message):
    with pytest.raises(ClusterError, match=message) as info:
        cluster_from_dict(with_host(host), source="f.yaml")
    assert str(info.value).startswith("f.yaml: servers[0].host") and "\n" not in str(info.value)


# ---------------------------------------------------------------------- topology
def test_host_of_and_host_memory_bytes():
    c = cluster_from_dict(with_host(HOST, 2))
    assert c.host_of(0) is c.servers[0].host
    assert c.host_memory_bytes(0) == 384 * 10**9
    assert c.host_memory_bytes(1) == 0                     # no host record: nothing can be offloaded
    with pytest.raises(ClusterError, match="server 's1' of device 's1/gpu0' has no 'host:' entry"):
        c.host_of(1)
    with pytest.raises(ClusterError, match="no device 2; devices are 0..1"):
        c.host_of(2)
    with pytest.raises(ClusterError, match="no server 5; servers are 0..1"):
        c.host_memory_bytes(5)


# ---------------------------------------------------------------------- built-in and generated hosts
@pytest.mark.parametrize("name", ["paper-8gpu", "paper-12gpu"])
def test_paper_testbeds_have_the_stated_dual_xeon_hosts(name):
    c = load_cluster(name)
    for s in c.servers:
        assert s.host is not None
        assert (s.host.cpu.name, s.host.sockets, s.host.memory_bytes) == ("Xeon-Gold-6148", 2, 384 * 10**9)
        assert (s.host.pcie_bandwidth_Bps, s.host.pcie_latency_s) == (12e9, 5e-6)


def test_clariden_nodes_have_four_grace_sockets_and_c2c():
    c = load_cluster("clariden:nodes=3")
    for s in c.servers:
        assert s.host is not None
        assert (s.host.cpu.name, s.host.sockets, s.host.memory_bytes) == ("Grace", 4, 480 * 10**9)
        assert (s.host.pcie_bandwidth_Bps, s.host.pcie_latency_s) == (450e9, 5e-6)
        assert s.host.memory_bandwidth_Bps == 4 * 500e9


def test_clusters_with_undescribed_hosts_have_none():
    for name in ("mixed-a100-v100-t4", "mit", "gcp-a100-v100", "local-cpu-2"):
        assert all(s.host is None for s in load_cluster(name).servers)


def test_server_host_follows_the_gpu_generation():
    assert server_host([{"type": "V100-16GB", "count": 2}]) == {
        "cpu": "Xeon-Gold-6148", "sockets": 2, "memory": "192 GB", "pcie": {"bandwidth": "12 GB/s"}}
    # 8 x 80 GiB = 687 GB; twice that is 1374 GB -> 1536 GB; H100 with a V100 -> Sapphire Rapids on PCIe 3.0
    assert server_host([{"type": "H100", "count": 7}, {"type": "V100-16GB", "count": 1}]) == {
        "cpu": "Xeon-Platinum-8480+", "sockets": 2, "memory": "1536 GB", "pcie": {"bandwidth": "12 GB/s"}}
    assert server_host([{"type": "GH200-96GB", "count": 4}]) is None


@pytest.mark.parametrize("seed", range(12))
def test_generated_servers_have_hosts_that_hold_twice_their_gpu_memory(seed):
    c = generate_cluster(seed)
    assert generate_cluster_dict(seed) == generate_cluster_dict(seed)
    for s in c.servers:
        assert s.host is not None
        gpu_bytes = sum(c.devices[i].type.memory_bytes for i in s.devices)
        assert s.host.memory_bytes >= min(2 * gpu_bytes, 2048e9)
        assert s.host.cpu.name in {cpu for cpu, _ in HOST_OF_GPU.values()}
