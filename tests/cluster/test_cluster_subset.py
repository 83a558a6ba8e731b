"""A cluster's subset (the devices an elastic run has left) and each server's storage bandwidth."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.cluster.loader import cluster_from_dict, cluster_to_dict
from heterog.cluster.topology import DEFAULT_STORAGE_BANDWIDTH_Bps, subset
from heterog.errors import ClusterError


def two_servers(**storage):
    servers = [{"name": "a", "gpus": ["V100-16GB", "V100-16GB"], "intra": {"kind": "nvlink", "bandwidth": "100 GB/s"},
                "nic": {"bandwidth": "100 Gbit/s"}, **storage},
               {"name": "b", "gpus": ["GTX-1080Ti"], "nic": {"bandwidth": "50 Gbit/s"}}]
    return cluster_from_dict({"name": "two", "servers": servers})


def test_a_server_without_devices_left_is_dropped_and_links_keep_their_speeds() -> None:
    c = two_servers()
    left = subset(c, ["a/gpu1", "b/gpu0"])
    assert left.name == "two[a/gpu1,b/gpu0]" and left.device_names == ["a/gpu1", "b/gpu0"]
    assert [s.name for s in left.servers] == ["a", "b"] and [d.server for d in left.devices] == [0, 1]
    assert left.bandwidth_Bps[0, 1] == c.bandwidth_Bps[1, 2] == 50e9 / 8
    only_a = subset(c, ["a/gpu0", "a/gpu1"])
    assert len(only_a.servers) == 1 and only_a.bandwidth_Bps[0, 1] == 100e9
    assert subset(c, c.device_names).name == "two"


def test_a_subset_in_the_ranks_order() -> None:
    c = load_cluster("local-cpu-3:slowdown=1,2,3")
    left = subset(c, ["localhost/cpu2", "localhost/cpu0"], ordered=True)
    assert left.device_names == ["localhost/cpu2", "localhost/cpu0"] and list(left.slowdown) == [3.0, 1.0]
    assert left.name != c.name and subset(c, c.device_names, ordered=True).name == c.name


@pytest.mark.parametrize(("keep", "message"), [(["x"], "has no device 'x'"), ([], "no device is left"),
                                               (["localhost/cpu0"] * 2, "devices named twice")])
def test_a_bad_subset_is_refused(keep, message) -> None:
    with pytest.raises(ClusterError, match=message):
        subset(load_cluster("local-cpu-2"), keep, ordered=True)


def test_storage_bandwidth_is_read_written_and_defaulted() -> None:
    c = two_servers(storage={"bandwidth": "3 GB/s"})
    assert [s.storage_bandwidth_Bps for s in c.servers] == [3e9, DEFAULT_STORAGE_BANDWIDTH_Bps]
    d = cluster_to_dict(c)
    assert d["servers"][0]["storage"] == {"bandwidth": "3 GB/s"} and "storage" not in d["servers"][1]
    assert cluster_from_dict(d).servers[0].storage_bandwidth_Bps == 3e9
    assert subset(c, ["a/gpu0"]).servers[0].storage_bandwidth_Bps == 3e9


@pytest.mark.parametrize(("storage", "message"), [
    ({"bandwidth": "0 GB/s"}, "must be positive"), ({"bandwidth": "1 GB/s", "speed": 1}, "speed"),
    ("fast", "a mapping")])
def test_a_bad_storage_entry_is_refused(storage, message) -> None:
    with pytest.raises(ClusterError, match=message):
        two_servers(storage=storage)
