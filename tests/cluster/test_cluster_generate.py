"""Generated clusters (heterog.cluster.generate): sizes in range, connected, deterministic per seed, catalog
types only, plausible links, and early rejection of a bad space."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.cluster.catalog import CATALOG
from heterog.cluster.generate import (
    GPU_TYPES,
    NVLINK_TYPES,
    ClusterSpace,
    generate_cluster,
    generate_cluster_dict,
    generate_clusters,
)
from heterog.cluster.loader import cluster_from_dict, cluster_to_dict
from heterog.errors import ClusterError

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS)
def test_sizes_types_and_links_are_in_range(seed):
    c = generate_cluster(seed)
    assert 2 <= c.n_devices <= 16 and 1 <= len(c.servers) <= 6
    assert all(1 <= len(s.devices) <= 8 for s in c.servers)
    types = {d.type.name for d in c.devices}
    assert types <= set(GPU_TYPES) and "cpu" not in types and 2 <= len(types) <= 3
    assert all(d.type == CATALOG[d.type.name] for d in c.devices)
    for s in c.servers:
        if len(s.devices) > 1:
            assert s.intra in ("nvlink", "pcie")
            if s.intra == "nvlink":
                assert len({c.devices[i].type.name for i in s.devices}) == 1
                assert c.devices[s.devices[0]].type.name in NVLINK_TYPES
        if len(c.servers) > 1:
            assert 10e9 / 8 <= s.nic_bandwidth_Bps <= 200e9 / 8


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS)
def test_every_pair_of_devices_is_connected(seed):
    c = generate_cluster(seed)
    off = ~np.eye(c.n_devices, dtype=bool)
    bandwidth = c.bandwidth_Bps[off]
    assert (bandwidth > 0).all() and np.isfinite(bandwidth).all()
    assert np.isfinite(c.latency_s[off]).all()


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS)
def test_a_seed_gives_one_cluster_that_round_trips_through_the_loader(seed):
    d = generate_cluster_dict(seed)
    assert d == generate_cluster_dict(seed)
    c = generate_cluster(seed)
    assert c.name == f"gen-{seed}"
    again = cluster_from_dict(cluster_to_dict(c))
    assert np.array_equal(again.bandwidth_Bps, c.bandwidth_Bps)
    assert [x.type.name for x in again.devices] == [x.type.name for x in c.devices]


def test_many_seeds_cover_the_space():
    clusters = generate_clusters(200, seed=0)
    assert {c.n_devices for c in clusters} == set(range(2, 17))
    assert {len(c.servers) for c in clusters} == set(range(1, 7))
    assert {d.type.name for c in clusters for d in c.devices} == set(GPU_TYPES)
    assert {s.intra for c in clusters for s in c.servers if len(s.devices) > 1} == {"nvlink", "pcie"}
    assert len({str(cluster_to_dict(c)) for c in clusters}) == 200


def test_a_smaller_space_is_respected():
    space = ClusterSpace(min_gpus=4, max_gpus=4, max_servers=2, gpu_types=("T4", "L4"), min_nic_Gbps=25,
                         max_nic_Gbps=50)
    for c in generate_clusters(20, seed=7, space=space):
        assert c.n_devices == 4 and len(c.servers) <= 2
        assert {d.type.name for d in c.devices} == {"T4", "L4"}
        for s in c.servers:
            assert len(c.servers) == 1 or s.nic_bandwidth_Bps in (25e9 / 8, 40e9 / 8, 50e9 / 8)


def test_a_bad_space_lists_every_problem():
    with pytest.raises(ClusterError) as err:
        ClusterSpace(min_gpus=5, max_gpus=3, gpu_types=("B200",), min_nic_Gbps=300, nvlink_p=2.0)
    message = str(err.value)
    for part in ("min_gpus=5 and max_gpus=3", "unknown: ['B200']", "no NIC speed", "nvlink_p=2.0"):
        assert part in message
    with pytest.raises(ClusterError, match="max_gpus=40 do not fit 2 servers of 8 GPUs"):
        ClusterSpace(max_gpus=40, max_servers=2)
    with pytest.raises(ClusterError, match="at least 0"):
        generate_clusters(-1)
    assert math.isfinite(generate_cluster(0).switch_bandwidth_Bps) or len(generate_cluster(0).servers) == 1


def test_load_cluster_knows_generated_names():
    from heterog.cluster import load_cluster

    assert cluster_to_dict(load_cluster("gen-5")) == cluster_to_dict(generate_cluster(5))
    with pytest.raises(ClusterError, match="gen-SEED"):
        load_cluster("gen-x")
