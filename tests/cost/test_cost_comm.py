"""Communication cost: transfers, ring vs hierarchical AllReduce by hand, PS aggregation."""
import math

import numpy as np
import pytest

from heterog.cluster import CATALOG, Cluster, Device, Server, load_cluster
from heterog.cost import CollectiveCost, CostModel, ProfileTable
from heterog.errors import StrategyError


def two_by_two(intra_Bps: float, intra_lat_s: float, nic_Bps: float, nic_lat_s: float) -> CostModel:
    """Two servers of two V100s. Links: s0 0->1 (0), 1->0 (1), nic-out (2), nic-in (3); s1 likewise 4..7."""
    t = CATALOG["V100-16GB"]
    devices = [Device(i, f"s{i // 2}/gpu{i % 2}", t, i // 2) for i in range(4)]
    servers = [Server(j, f"s{j}", [2 * j, 2 * j + 1], "nvlink", intra_Bps, intra_lat_s, nic_Bps, nic_lat_s)
               for j in range(2)]
    return CostModel(Cluster("2x2", devices, [], servers, math.inf))


def test_transfer_times_paper12():
    cm = CostModel(load_cluster("paper-12gpu"))
    t = cm.transfer_times(np.array([0, 0, 4, 3]), np.array([1, 4, 0, 3]), np.array([1e9, 1e9, 1e6, 1e9]))
    assert t == pytest.approx([2e-6 + 1e9 / 45e9, 20e-6 + 1e9 / 6.25e9, 20e-6 + 1e6 / 6.25e9, 0.0], rel=1e-12)


def test_link_profile_overrides_alpha_beta():
    profile = ProfileTable()
    profile.set_link("pcie", 1e-5, 1e-10)             # by kind: every PCIe link
    profile.set_link("s1/nic-in", 3e-5, 2e-10)        # by name: one NIC
    cm = CostModel(load_cluster("paper-8gpu"), profile)
    t = cm.transfer_times(np.array([0, 0, 2]), np.array([1, 2, 0]), np.array([1e6, 1e6, 1e6]))
    # 0->2: s0/nic-out unprofiled (10 us, 1/12.5e9) + s1/nic-in profiled; beta is the larger
    assert t == pytest.approx([1e-5 + 1e6 * 1e-10, 10e-6 + 3e-5 + 1e6 * 2e-10, 20e-6 + 1e6 / 6.25e9], rel=1e-12)


def test_ring_and_hierarchical_by_hand_hierarchical_wins():
    cm = two_by_two(intra_Bps=100e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=5e-6)
    x = 1e8
    ring = 2 * 3 / 4 * x / 10e9 + 2 * 3 * 10e-6                     # bottleneck hop crosses servers
    half_intra = 1 / 2 * x / 100e9 + 1 * 1e-6                       # reduce (= broadcast) inside a server
    across = 2 * 1 / 2 * x / 10e9 + 2 * 1 * 10e-6                   # ring over the two leaders
    hier = half_intra + across + half_intra
    r = cm.allreduce([0, 1, 2, 3], x, "ring")
    h = cm.allreduce([0, 1, 2, 3], x, "hierarchical")
    assert r.time_s == pytest.approx(ring, rel=1e-12) and h.time_s == pytest.approx(hier, rel=1e-12)
    assert r.links == (0, 2, 3, 4, 6, 7) and h.links == tuple(range(8))
    auto = cm.allreduce([0, 1, 2, 3], x)
    assert auto == CollectiveCost(h.time_s, "hierarchical", h.links)


def test_ring_wins_when_intra_is_as_slow_as_the_nic():
    cm = two_by_two(intra_Bps=10e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=1e-6)
    x = np.array([1e8, 1e3])
    ring = 1.5 * x / 10e9 + 6 * 2e-6
    hier = (0.5 * x / 10e9 + 1e-6) * 2 + (x / 10e9 + 2 * 2e-6)
    times, algos = cm.allreduce_times([0, 1, 2, 3], x)
    assert times == pytest.approx([ring[0], hier[1]], rel=1e-12)      # big: ring; small: fewer latencies
    assert algos.tolist() == ["ring", "hierarchical"]
    assert cm.allreduce([0, 1, 2, 3], 1e8).algo == "ring"


def test_ring_follows_given_order():
    cm = two_by_two(intra_Bps=100e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=5e-6)
    # order 0,2,1,3 crosses servers on every hop: same bottleneck, but all four hops use NICs
    assert cm.allreduce([0, 2, 1, 3], 1e8, "ring").links == (2, 3, 6, 7)


def test_single_device_and_one_server_cases():
    cm = two_by_two(intra_Bps=100e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=5e-6)
    assert cm.allreduce([3], 1e8) == CollectiveCost(0.0, "none", ())
    assert cm.allreduce([3, 3], 1e8) == CollectiveCost(0.0, "none", ())
    same = cm.allreduce([0, 1], 1e8)
    assert same.algo == "ring" and same.time_s == pytest.approx(1e8 / 100e9 + 2e-6, rel=1e-12)
    assert same.links == (0, 1)


def test_unknown_algorithm():
    cm = CostModel(load_cluster("paper-8gpu"))
    with pytest.raises(StrategyError, match="'tree'"):
        cm.allreduce([0, 1], 1e6, "tree")


def test_aggregate_time_is_memory_bound_plus_launch():
    cm = CostModel(load_cluster("local-cpu-2:slowdown=1,2"))
    cpu = CATALOG["cpu"]
    expected = 4 * 1e8 / cpu.effective_memory_Bps + cpu.launch_overhead_s
    assert cm.aggregate_time(0, 1e8, 3) == pytest.approx(expected, rel=1e-12)
    assert cm.aggregate_time(1, 1e8, 3) == pytest.approx(2 * expected, rel=1e-12)
    assert cm.aggregate_time(0, 1e8, 0) == 0.0


def test_copy_times_read_and_write_once():
    cm = CostModel(load_cluster("paper-8gpu"))
    v100 = CATALOG["V100-16GB"]
    t = cm.copy_times(np.array([0, 0]), np.array([1e8, 0.0]))
    assert t == pytest.approx([2e8 / v100.effective_memory_Bps + v100.launch_overhead_s, 0.0], rel=1e-12)


def test_none_algorithm_only_for_one_device():
    cm = CostModel(load_cluster("paper-8gpu"))
    assert cm.allreduce([2], 1e6, "none") == CollectiveCost(0.0, "none", ())
    assert cm.allreduce([2], 1e6, "ring").algo == "none"
    with pytest.raises(StrategyError, match=r"'none' is for one device, got devices \[0, 1\]"):
        cm.allreduce([0, 1], 1e6, "none")


def test_measured_allreduce_replaces_both_formulas_for_its_device_set_only():
    cluster = load_cluster("paper-8gpu")
    profile = ProfileTable()
    names = [cluster.devices[d].name for d in (0, 1)]
    profile.add_collective("allreduce", names[::-1], [0, 1e6], [1e-3, 3e-3])      # key is order-free
    cm = CostModel(cluster, profile)
    for algo in ("auto", "ring", "hierarchical"):
        times, algos = cm.allreduce_times([1, 0], np.array([0.0, 5e5, 2e6]), algo)
        assert times == pytest.approx([1e-3, 2e-3, 5e-3], rel=1e-9)
        assert algos.tolist() == ["ring"] * 3
    assert cm.allreduce([0], 1e6).links == () and cm.allreduce([0, 1], 1e6).links == cm.allreduce_links([0, 1], "ring")
    # another device set keeps the formula
    plain = CostModel(cluster)
    x = np.array([1e6])
    assert cm.allreduce_times([0, 2], x)[0] == pytest.approx(plain.allreduce_times([0, 2], x)[0])


def test_profiled_latency_in_flight_sums_over_the_path_and_is_0_elsewhere():
    profile = ProfileTable()
    profile.set_link("pcie", 1e-5, 1e-10, latency_s=4e-5, latency_s_per_byte=1e-11)   # by kind: every PCIe link
    profile.set_link("s1/nic-in", 3e-5, 2e-10, latency_s=7e-5)                        # by name: one NIC
    cm = CostModel(load_cluster("paper-8gpu"), profile)
    src, dst = np.array([0, 0, 2, 1]), np.array([1, 2, 0, 1])
    # 0->1 one PCIe link; 0->2 s0/nic-out (no latency profiled) + s1/nic-in; 2->0 s1/nic-out + s0/nic-in
    # (neither profiled); 1->1 nothing moves
    nbytes = np.array([1e6, 1e6, 1e6, 1e6])
    assert cm.transfer_latencies(src, dst, nbytes) == pytest.approx([4e-5 + 1e-5, 7e-5, 0.0, 0.0], abs=1e-15)
    # the occupancy is unchanged by the latency
    assert cm.transfer_times(src[:1], dst[:1], np.array([1e6])) == pytest.approx([1e-5 + 1e6 * 1e-10], rel=1e-12)
    assert not CostModel(load_cluster("paper-8gpu")).transfer_latencies(src, dst, nbytes).any()


def test_sharded_ring_of_uneven_shards_by_hand():
    # ring 0 -> 1 (NVLink: 1 us, 100 GB/s) -> 2 (across servers: 5 + 5 us, 10 GB/s) -> 3 -> 0 (across)
    cm = two_by_two(intra_Bps=100e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=5e-6)
    intra = (1e-6, 1 / 100e9)
    cross = (10e-6, 1 / 10e9)
    hops = [intra, cross, intra, cross]
    shards = [1e6, 2e6, 3e6, 4e6]

    def step(t: int) -> float:                      # hop i passes the shard that started on device i - t
        return max(a + shards[(i - t) % 4] * b for i, (a, b) in enumerate(hops))

    expected = step(0) + step(1) + step(2)
    assert expected == pytest.approx(4.1e-4 + 3.1e-4 + 4.1e-4, rel=1e-12)  # the largest shard crossing a NIC
    got = cm.sharded_ring_times([0, 1, 2, 3], np.array([shards, [2.5e6] * 4]))
    assert got[0] == pytest.approx(expected, rel=1e-12)
    # even shards: half the ring AllReduce of the whole tensor
    assert got[1] == pytest.approx(cm.allreduce([0, 1, 2, 3], 1e7, "ring").time_s / 2, rel=1e-12)
    assert cm.sharded_ring_times([2], np.array([[5e6]])).tolist() == [0.0]
    with pytest.raises(StrategyError, match="one shard per device"):
        cm.sharded_ring_times([0, 1, 2], np.array([[1.0, 2.0]]))


def test_gradients_in_buckets_pay_the_fixed_time_once_per_bucket():
    """Four V100s on two servers, intra as slow as the NIC: the ring's fixed time is 6 steps x (1 + 1) us. In
    buckets of 4 MB a 1 MB gradient pays a quarter of it, a 10 MB one all of it; four 1 MB gradients, one
    bucket, together pay exactly what one 4 MB AllReduce does."""
    x = np.array([1e6, 1e7])
    plain = two_by_two(intra_Bps=10e9, intra_lat_s=1e-6, nic_Bps=10e9, nic_lat_s=1e-6)
    cm = CostModel(plain.cluster, allreduce_bucket_bytes=4e6)
    fixed = 6 * 2e-6
    ring = 1.5 * x / 10e9
    times, algos = cm.gradient_allreduce_times([0, 1, 2, 3], x)
    assert times == pytest.approx([ring[0] + fixed / 4, ring[1] + fixed], rel=1e-12)
    assert algos.tolist() == ["ring", "ring"]
    four = cm.gradient_allreduce_times([0, 1, 2, 3], np.full(4, 1e6))[0].sum()
    assert four == pytest.approx(plain.allreduce_times([0, 1, 2, 3], np.array([4e6]), "ring")[0][0], rel=1e-12)
    # without buckets a gradient's AllReduce is priced alone (the default; heterog's runtime)
    assert plain.gradient_allreduce_times([0, 1, 2, 3], x)[0] == pytest.approx(plain.allreduce_times(
        [0, 1, 2, 3], x)[0], rel=1e-12)
    with pytest.raises(StrategyError, match="allreduce_bucket_bytes"):
        CostModel(plain.cluster, allreduce_bucket_bytes=-1.0)
