"""Clusters of Sailor's published runs: device counts and types, links derived from Sailor's fits, aliases of
its GPU names, and errors naming a bad option."""
import pytest

from heterog.cluster import load_cluster
from heterog.cluster.catalog import ALIASES, CATALOG, device_type, resolve_type, sailor_type
from heterog.cluster.published import INTER_FILE, INTRA_FILE, SAILOR_FITS, alpha_beta, fit_bandwidth_Bps
from heterog.errors import ClusterError


@pytest.mark.parametrize("sailor, ours", [("GH-96", "GH200-96GB"), ("A100-40", "A100-40GB"),
                                          ("A100-80", "A100-80GB"), ("V100-16", "V100-16GB"),
                                          ("RTX-2080", "RTX-2080Ti"), ("RTX-3090", "RTX-3090"),
                                          ("Titan-RTX", "Titan-RTX"), ("gh-96", "GH200-96GB")])
def test_sailor_names_resolve_to_catalog_types(sailor, ours):
    assert sailor_type(sailor) == ours
    assert resolve_type(ours) == ours and set(ALIASES.values()) <= set(CATALOG)
    if sailor not in CATALOG:              # a name of Sailor's files alone means the same type everywhere
        assert resolve_type(sailor) == ours and device_type(sailor) is CATALOG[ours]


def test_a_catalog_name_keeps_its_meaning_outside_sailors_files():
    # Sailor's "RTX-2080" is an 11 GiB card; written in a cluster file the name is the 8 GB RTX 2080
    assert resolve_type("RTX-2080") == "RTX-2080" and sailor_type("RTX-2080") == "RTX-2080Ti"
    with pytest.raises(ClusterError, match="unknown device type 'RTX-9999'"):
        sailor_type("RTX-9999")


def test_new_catalog_types_carry_datasheet_numbers():
    gh, h100 = CATALOG["GH200-96GB"], CATALOG["H100"]
    assert gh.memory_bandwidth_Bps == 4.0e12 and gh.memory_bytes == 96 * 2**30
    assert (gh.peak_flops, gh.tensor_flops, gh.compute_efficiency) == (h100.peak_flops, h100.tensor_flops,
                                                                     h100.compute_efficiency)
    assert CATALOG["RTX-2080"].memory_bytes == 8 * 2**30 and CATALOG["Titan-RTX"].memory_bytes == 24 * 2**30
    assert CATALOG["RTX-2080Ti"].memory_bytes == 11 * 2**30
    turing = {(CATALOG[t].compute_efficiency, CATALOG[t].memory_efficiency) for t in
              ("T4", "RTX-2080", "RTX-2080Ti", "Titan-RTX")}
    assert turing == {(0.60, 0.75)}


def test_unknown_alias_lists_known_names():
    with pytest.raises(ClusterError, match=r"unknown device type 'GH-120'.*aliases: GH-96"):
        device_type("GH-120")


def test_fit_and_alpha_beta_by_hand():
    # bandwidth at 1 MB is the constant term: log2(1e6 / 1e6) = 0
    assert fit_bandwidth_Bps((-1.0, 2.0, 3.0), 1e6) == 3e9
    # a max of 8 GB/s summed over 2 pairs: B = 4 GB/s per pair; the fit 8 * l GB/s (summed) first reaches
    # 2 * B / 2 = 4 GB/s at l = 0.5, so n_1/2 = 2^0.5 MB (on the 2^0.01 grid) and the latency is n_1/2 / B
    bandwidth_Bps, latency_s = alpha_beta(((0.0, 8.0, 0.0), 8e9), 2, "pcie")
    assert bandwidth_Bps == 4e9
    n_half = 1e6 * 2**0.5
    assert n_half <= latency_s * 4e9 <= n_half * 2**0.01
    # above half already at 2^16 bytes: the data only bound it, the kind's default is used
    assert alpha_beta(((0.0, 0.0, 1.0), 1e9), 1, "nic") == (1e9, 10 / 1e6)


def test_clariden_nodes_of_four_gh200():
    c = load_cluster("clariden:nodes=16")
    assert len(c.devices) == 64 and len(c.servers) == 16 and {d.type.name for d in c.devices} == {"GH200-96GB"}
    s = c.servers[0]
    fit_intra, fit_inter = SAILOR_FITS[(INTRA_FILE, "GH-96", 4)], SAILOR_FITS[(INTER_FILE, "GH-96", 4)]
    assert s.intra == "nvlink" and s.intra_bandwidth_Bps == fit_intra[1] / 2      # two pairs measured at once
    assert s.nic_bandwidth_Bps == fit_inter[1]                                    # 92.6 GB/s per node
    assert 11e-6 < s.nic_latency_s < 12e-6 and 26e-6 < s.intra_latency_s < 27e-6
    assert load_cluster("clariden").name == "clariden:nodes=4" and len(load_cluster("clariden").devices) == 16


def test_mit_nodes_per_type():
    c = load_cluster("mit:rtx3090=2,rtx2080=2,titan-rtx=1")
    types = [d.type.name for d in c.devices]
    assert types == ["RTX-3090"] * 16 + ["Titan-RTX"] * 8 + ["RTX-2080Ti"] * 16
    by_name = {s.name: s for s in c.servers}
    assert by_name["rtx3090-1"].nic_bandwidth_Bps == SAILOR_FITS[(INTER_FILE, "RTX-3090", 8)][1]
    assert by_name["titan-rtx-0"].intra_bandwidth_Bps == SAILOR_FITS[(INTRA_FILE, "Titan-RTX", 8)][1] / 4
    assert all(s.intra == "pcie" for s in c.servers)
    # the 1 GbE of the RTX-3090 node bounds every transfer that leaves or enters it
    first_2080 = types.index("RTX-2080Ti")
    assert c.bandwidth_Bps[0, first_2080] == by_name["rtx3090-0"].nic_bandwidth_Bps
    default = load_cluster("mit")
    assert [d.type.name for d in default.devices] == ["RTX-3090"] * 8 + ["Titan-RTX"] * 16 + ["RTX-2080Ti"] * 24


def test_gcp_a100_v100_nodes():
    c = load_cluster("gcp-a100-v100:a100=1,v100=2")
    assert [d.type.name for d in c.devices] == ["A100-40GB"] * 4 + ["V100-16GB"] * 8
    a100, v100 = c.servers[0], c.servers[1]
    assert a100.nic_bandwidth_Bps == SAILOR_FITS[(INTER_FILE, "A100-40", 4)][1]
    assert v100.intra_bandwidth_Bps == SAILOR_FITS[(INTRA_FILE, "V100-16", 4)][1] / 2
    assert c.bandwidth_Bps[0, 4] == min(a100.nic_bandwidth_Bps, v100.nic_bandwidth_Bps)
    single = load_cluster("gcp-a100-v100:a100=2,v100=0,gpus_per_node=1")
    assert len(single.devices) == 2 and single.servers[0].nic_bandwidth_Bps == \
        SAILOR_FITS[(INTER_FILE, "A100-40", 1)][1]


@pytest.mark.parametrize("spec, message", [
    ("clariden:nodes=0", "no servers"),
    ("clariden:gpus=4", "unknown or repeated option 'gpus=4'.*options of 'clariden': nodes"),
    ("clariden:nodes=4,nodes=8", "repeated option"),
    ("mit:rtx3090=two", "'rtx3090' must be an integer"),
    ("mit:titan-rtx=-1", "must be >= 0"),
    ("gcp-a100-v100:gpus_per_node=8", "gpus_per_node must be 1, 2 or 4"),
])
def test_bad_options_are_named(spec, message):
    with pytest.raises(ClusterError, match=message):
        load_cluster(spec)
