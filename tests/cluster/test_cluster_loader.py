"""YAML loader: units, built-ins, round trips, local-cpu-N specs and errors naming the bad field."""
import math
import textwrap

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.cluster import CATALOG, builtin_names, load_cluster
from heterog.cluster.loader import (
    BANDWIDTH_UNITS_Bps,
    _format_quantity,
    cluster_from_dict,
    cluster_to_dict,
    parse_bandwidth_Bps,
    parse_memory_bytes,
    save_cluster_yaml,
)
from heterog.errors import ClusterError

BUILTINS = ["consumer-3090-4090", "mixed-a100-v100-t4", "mixed-h100-a100-l4", "paper-12gpu", "paper-8gpu"]


def write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def one_server(tmp_path, gpus: str = "[V100-16GB, V100-16GB]", intra: str = "{kind: pcie, bandwidth: 12 GB/s}"):
    return write(tmp_path, f"""
        name: t
        servers:
          - name: s0
            gpus: {gpus}
            intra: {intra}
        """)


@pytest.mark.parametrize("text, value", [("100 Gbit/s", 1.25e10), ("50 Gb/s", 6.25e9), ("12 GB/s", 12e9),
                                         ("1GiB/s", 2.0**30), ("800 MB/s", 8e8), ("100 Mbit/s", 1.25e7)])
def test_bandwidth_units(text, value):
    assert parse_bandwidth_Bps(text, "f") == value


def test_memory_units():
    assert parse_memory_bytes("16 GiB", "m") == 16 * 2**30 and parse_memory_bytes("16 GB", "m") == 16 * 10**9


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1.0, max_value=1e15, allow_nan=False, allow_infinity=False))
def test_formatted_bandwidth_reads_back_exactly(value):
    text = _format_quantity(value, ("Gbit/s", "GB/s"), BANDWIDTH_UNITS_Bps, "B/s")
    assert parse_bandwidth_Bps(text, "f") == value


def test_builtin_names():
    assert builtin_names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS + ["local-cpu-3:slowdown=1,2,1:bandwidth=1GB/s:latency_us=50"])
def test_yaml_round_trip(tmp_path, name):
    c = load_cluster(name)
    assert cluster_from_dict(cluster_to_dict(c)) == c
    path = save_cluster_yaml(c, tmp_path / f"{name.split(':')[0]}.yaml")
    again = load_cluster(path)
    assert again == c and again.name == c.name
    assert again.bandwidth_Bps.tolist() == c.bandwidth_Bps.tolist()


def test_paper8_layout():
    c = load_cluster("paper-8gpu")
    assert [d.type.name for d in c.devices] == ["V100-16GB"] * 2 + ["GTX-1080Ti"] * 4 + ["P100-12GB"] * 2
    assert [s.nic_bandwidth_Bps for s in c.servers] == [12.5e9, 6.25e9, 6.25e9, 6.25e9]
    assert c.switch_bandwidth_Bps == 12.5e9 and all(s.intra == "pcie" for s in c.servers)


def test_local_cpu_spec_parses():
    c = load_cluster("local-cpu-3:slowdown=1,2,1:bandwidth=1GB/s")
    assert c.n_devices == 3 and len(c.servers) == 1 and c.servers[0].name == "localhost"
    assert [d.slowdown for d in c.devices] == [1.0, 2.0, 1.0]
    assert c.power.tolist() == [50e9, 25e9, 50e9]
    assert {k.kind for k in c.links} == {"loopback"} and c.n_links == 6
    assert c.bandwidth_Bps[0, 2] == 1e9 and c.latency_s[0, 2] == pytest.approx(20e-6)
    plain = load_cluster("local-cpu-1")
    assert plain.n_devices == 1 and plain.n_links == 0 and plain.devices[0].type == CATALOG["cpu"]
    assert [d.slowdown for d in load_cluster("local-cpu-2:slowdown=3").devices] == [3.0, 3.0]


def test_a_local_cpu_cluster_may_describe_its_host_side():
    """``host=`` gives the machine a host of that CPU type (one socket, 16 GB unless ``host_memory`` says
    otherwise, the loopback link's speed to each worker), so that plans may offload state to it."""
    assert load_cluster("local-cpu-2").servers[0].host is None
    h = load_cluster("local-cpu-2:bandwidth=1GB/s:host=Xeon-Gold-6148").servers[0].host
    assert h is not None and (h.cpu.name, h.sockets, h.memory_bytes) == ("Xeon-Gold-6148", 1, 16 * 10**9)
    assert (h.pcie_bandwidth_Bps, h.pcie_latency_s) == (1e9, pytest.approx(20e-6))
    c = load_cluster("local-cpu-3:host=EPYC-7742:host_memory=4GB")
    assert c.host_memory_bytes(0) == 4 * 10**9


@pytest.mark.parametrize("spec, message", [
    ("local-cpu-0", r"'local-cpu-0': expected local-cpu-N"),
    ("local-cpu-3:slowdown=1,2", r"option 'slowdown': 2 factors for 3 workers"),
    ("local-cpu-2:slowdown=1,-1", r"option 'slowdown': factors must be positive"),
    ("local-cpu-2:bandwidth=5", r"option 'bandwidth'.*'5' has no unit"),
    ("local-cpu-2:speed=2", r"unknown option 'speed'"),
    ("local-cpu-2:host=Pentium", r"unknown host CPU type 'Pentium'"),
    ("local-cpu-2:host_memory=4GB", r"host_memory needs host="),
])
def test_bad_local_cpu_specs(spec, message):
    with pytest.raises(ClusterError, match=message):
        load_cluster(spec)


def test_explicit_and_overridden_gpu_types_round_trip(tmp_path):
    p = one_server(tmp_path, gpus="[{name: MyGPU, peak_tflops: 10, memory_bandwidth: 500 GB/s, memory: 8 GiB}, "
                                  "{type: V100-16GB, compute_efficiency: 0.5, count: 2, slowdown: 1.5}]")
    c = load_cluster(p)
    assert c.devices[0].type.name == "MyGPU" and c.devices[0].type.peak_flops == 10e12
    assert c.devices[0].type.memory_bytes == 8 * 2**30 and c.devices[0].type.tensor_flops is None
    assert c.devices[1].type.compute_efficiency == 0.5 and c.devices[2].slowdown == 1.5
    assert c.devices[1].type.peak_flops == CATALOG["V100-16GB"].peak_flops
    assert load_cluster(save_cluster_yaml(c, tmp_path / "again.yaml")) == c


def test_host_driven_comm_flag(tmp_path):
    assert CATALOG["cpu"].host_driven_comm and not CATALOG["V100-16GB"].host_driven_comm
    assert all(d.type.host_driven_comm for d in load_cluster("local-cpu-2").devices)
    c = load_cluster(one_server(tmp_path, gpus="[{type: T4, host_driven_comm: true}, T4]"))
    assert [d.type.host_driven_comm for d in c.devices] == [True, False]
    assert load_cluster(save_cluster_yaml(c, tmp_path / "again.yaml")) == c
    with pytest.raises(ClusterError, match=r"gpus\[0\]\.host_driven_comm: must be true or false, got 'yes'"):
        load_cluster(one_server(tmp_path, gpus="[{type: T4, host_driven_comm: 'yes'}]"))


def test_unknown_device_type_in_yaml(tmp_path):
    with pytest.raises(ClusterError, match=r"servers\[0\]\.gpus\[1\].*unknown device type 'FooGPU'"):
        load_cluster(one_server(tmp_path, gpus="[V100-16GB, FooGPU]"))


@pytest.mark.parametrize("intra, message", [
    ("{kind: pcie, bandwidth: 0 GB/s}", r"servers\[0\]\.intra\.bandwidth: bandwidth must be positive, got '0 GB/s'"),
    ("{kind: pcie, bandwidth: -5 GB/s}", r"servers\[0\]\.intra\.bandwidth: bandwidth must be positive, got '-5"),
    ("{kind: pcie, bandwidth: 12}", r"servers\[0\]\.intra\.bandwidth: bandwidth 12 has no unit"),
    ("{kind: pcie, bandwidth: 12 GHz}", r"servers\[0\]\.intra\.bandwidth: bandwidth '12 GHz' has unknown unit 'GHz'"),
    ("{kind: infiniband, bandwidth: 12 GB/s}", r"servers\[0\]\.intra\.kind: unknown kind 'infiniband'"),
    ("{kind: pcie, bandwidth: 12 GB/s, latency_us: -1}", r"servers\[0\]\.intra\.latency_us: must be >= 0"),
    ("{kind: pcie, bw: 12 GB/s}", r"servers\[0\]\.intra: unknown key\(s\) 'bw'"),
])
def test_bad_intra_names_the_field(tmp_path, intra, message):
    with pytest.raises(ClusterError, match=message):
        load_cluster(one_server(tmp_path, intra=intra))


def test_memory_without_unit(tmp_path):
    p = one_server(tmp_path, gpus="[{name: X, peak_tflops: 1, memory_bandwidth: 1 GB/s, memory: 16}]")
    with pytest.raises(ClusterError, match=r"gpus\[0\]\.memory: memory 16 has no unit"):
        load_cluster(p)


def test_disconnected_yaml_names_the_servers(tmp_path):
    p = write(tmp_path, """
        name: split
        servers:
          - {name: a, gpus: [T4], nic: {bandwidth: 10 Gbit/s}}
          - {name: b, gpus: [T4]}
        """)
    with pytest.raises(ClusterError, match=r"'split' is disconnected: servers b have no NIC"):
        load_cluster(p)


def test_zero_nic_bandwidth_in_yaml(tmp_path):
    p = write(tmp_path, """
        servers:
          - {name: a, gpus: [T4], nic: {bandwidth: 0 Gbit/s}}
          - {name: b, gpus: [T4], nic: {bandwidth: 10 Gbit/s}}
        """)
    with pytest.raises(ClusterError, match=r"servers\[0\]\.nic\.bandwidth: bandwidth must be positive"):
        load_cluster(p)


def test_unknown_builtin_lists_builtins():
    with pytest.raises(ClusterError, match=r"unknown cluster 'paper-9gpu'.*paper-12gpu, paper-8gpu, local-cpu-N"):
        load_cluster("paper-9gpu")


def test_bad_yaml_names_the_file(tmp_path):
    p = write(tmp_path, "servers: [unclosed\n", name="broken.yaml")
    with pytest.raises(ClusterError, match=r"broken\.yaml.*not valid YAML"):
        load_cluster(p)
    p = write(tmp_path, "name: x\n", name="empty.yaml")
    with pytest.raises(ClusterError, match=r"empty\.yaml.*'servers' must be a non-empty list"):
        load_cluster(p)


def test_name_defaults_to_file_stem_and_switch_is_optional(tmp_path):
    p = write(tmp_path, yaml.safe_dump({"servers": [{"gpus": ["L4"]}]}), name="solo.yaml")
    c = load_cluster(p)
    assert c.name == "solo" and c.servers[0].name == "s0" and c.switch_bandwidth_Bps == math.inf
