"""Clusters of Sailor's published runs (eth-easl/sailor, SOSP'25, commit cf2c8e3), sized by parameters:
``clariden:nodes=N``, ``mit:rtx3090=a,titan-rtx=b,rtx2080=c`` and ``gcp-a100-v100:a100=a,v100=b``.

Links come from Sailor's NCCL send/recv measurements (``sailor/providers/*.json``). Each entry there is
``[[c2, c1, c0], max_Bps]``: a quadratic fit of bandwidth (GB/s) against l = log2(message bytes / 1e6) over
messages of 2^16..2^30 bytes (``sailor/profiling/networking/run_all.py``, ``fit_func.py``), and the largest
bandwidth measured. A measurement with k GPUs runs k/2 send/recv pairs at once (within a node) or k pairs
(between two nodes of k GPUs) and records their sum (``test_sendrecv.py``). Derivation (``alpha_beta``):

- bandwidth: the largest measured sum divided by the pairs that shared it. Within a node, the node's full
  measurement (all its GPUs paired at once), so a link carries what one pair gets while every GPU
  communicates, as in a tensor-parallel all-reduce; between nodes, the node's NIC is the sum over all its
  GPUs (the topology has one NIC per server).
- latency: Hockney's half-performance length n_1/2, the message size at which the fit reaches half of that
  bandwidth, over the bandwidth (an alpha-beta link reaches B/2 at n = alpha * B). Where the fit is already
  above B/2 at the smallest measured message, the data only bound the latency from above (2^16 B / B) and
  the loader's default for the link kind is used instead (``DEFAULT_LATENCY_US``).

Hosts: clariden's nodes carry theirs (``CLARIDEN_HOST``); the hosts of mit's and gcp-a100-v100's servers are
not described by Sailor, so those servers have none (nothing can be offloaded to them).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from heterog.cluster.catalog import sailor_type
from heterog.cluster.loader import DEFAULT_LATENCY_US, cluster_from_dict
from heterog.cluster.topology import Cluster
from heterog.errors import ClusterError

SOURCE = "eth-easl/sailor@cf2c8e3"
INTRA_FILE = "sailor/providers/intra_node_bandwidths.json"
INTER_FILE = "sailor/providers/multizone_bandwidths.json"   # zone us-central1-a to itself, same type
SMALLEST_MESSAGE_BYTES = 2**16
LARGEST_MESSAGE_BYTES = 2**30

Fit = tuple[tuple[float, float, float], float]

# (file, Sailor GPU name, GPUs per node) -> the entry of that file, copied unchanged
SAILOR_FITS: dict[tuple[str, str, int], Fit] = {
    (INTRA_FILE, "GH-96", 4): ((-0.75177369, 26.46781337, 82.0621593), 250558342885.70334),
    (INTRA_FILE, "RTX-3090", 8): ((-0.01911446, 0.28085392, 4.33201444), 5326931791.867119),
    (INTRA_FILE, "RTX-2080", 8): ((-0.24085997, 2.90752869, 17.4770778), 24551701788.10586),
    (INTRA_FILE, "Titan-RTX", 8): ((-0.20205836, 2.62227596, 16.80709202), 24304314860.57957),
    (INTRA_FILE, "A100-40", 2): ((0.80818532, 16.40103598, 32.98046678), 248876169884.0839),
    (INTRA_FILE, "A100-40", 4): ((0.8303558, 15.58397854, 31.19114521), 243214602913.50012),
    (INTRA_FILE, "V100-16", 2): ((-0.2045115, 7.21163513, 22.24208487), 68281636948.0),
    (INTRA_FILE, "V100-16", 4): ((-0.2167128, 7.26270922, 22.51179176), 68172954066.0),
    (INTER_FILE, "GH-96", 4): ((-0.65351182, 11.42553946, 45.25031399), 92551901043.9898),
    (INTER_FILE, "RTX-3090", 8): ((-3.7061267e-05, 0.000628011631, 0.111391008), 114876125.2999855),
    (INTER_FILE, "RTX-2080", 8): ((-0.000924772745, 0.0100507644, 2.83913787), 2857736368.63897),
    (INTER_FILE, "Titan-RTX", 8): ((-0.00179076492, 0.0180836507, 2.83195173), 2857712076.5443),
    (INTER_FILE, "A100-40", 1): ((-0.0024414231124647644, 0.1408627339370467, 1.116822757126346),
                                 2420367713.517156),
    (INTER_FILE, "A100-40", 2): ((-0.007196511652909052, 0.2316852991952904, 2.1127137995063974),
                                 3674915935.759112),
    (INTER_FILE, "A100-40", 4): ((-0.03667895496478979, 0.4773282044079026, 4.5592610071684785),
                                 6035913051.04673),
    (INTER_FILE, "V100-16", 1): ((0.004408380557873316, 0.046579932153075286, 0.8793574711743694),
                                 1719640629.4376426),
    (INTER_FILE, "V100-16", 2): ((-0.011532109309884275, 0.10561766868954804, 1.7758034087071715),
                                 2903571884.3939266),
    (INTER_FILE, "V100-16", 4): ((-0.008450897567554275, 0.32345407867588116, 3.446937175278422),
                                 5787468328.312377),
}


def fit_bandwidth_Bps(coeffs: tuple[float, float, float], message_bytes: float) -> float:
    """Sailor's fitted bandwidth (summed over the pairs measured) for messages of ``message_bytes``."""
    level = math.log2(message_bytes / 1e6)
    c2, c1, c0 = coeffs
    return (c2 * level * level + c1 * level + c0) * 1e9


def alpha_beta(fit: Fit, pairs: int, kind: str) -> tuple[float, float]:
    """(bandwidth_Bps, latency_s) of one pair from a Sailor fit shared by ``pairs`` pairs (module docstring);
    ``kind`` names the loader default used when the data only bound the latency."""
    coeffs, max_Bps = fit
    bandwidth_Bps = max_Bps / pairs
    steps = 1400   # 2^16..2^30 in steps of 2^0.01
    for i in range(steps + 1):
        message_bytes = SMALLEST_MESSAGE_BYTES * 2.0 ** (14 * i / steps)
        if fit_bandwidth_Bps(coeffs, message_bytes) / pairs >= bandwidth_Bps / 2:
            if i == 0:
                return bandwidth_Bps, DEFAULT_LATENCY_US[kind] / 1e6
            return bandwidth_Bps, message_bytes / bandwidth_Bps
    raise ClusterError(f"Sailor fit {fit} never reaches half of its measured maximum over 2^16..2^30 bytes")


def _link(file: str, gpu: str, gpus_per_node: int, kind: str) -> dict[str, Any]:
    pairs = gpus_per_node // 2 if file == INTRA_FILE else 1
    bandwidth_Bps, latency_s = alpha_beta(SAILOR_FITS[(file, gpu, gpus_per_node)], pairs, kind)
    out: dict[str, Any] = {"bandwidth": f"{bandwidth_Bps!r} B/s", "latency_s": latency_s}
    if file == INTRA_FILE:
        out["kind"] = kind
    return out


# One Alps GH200 node: four GH200 modules, each a Grace CPU (72 Neoverse V2 cores) with its own LPDDR5X
# (CSCS Alps hardware documentation, docs.cscs.ch: four Grace-Hopper modules per node). NVIDIA's GH200
# datasheet lists 120 GB of LPDDR5X in the configuration with 96 GB HBM3 (128 GB physical, ECC and
# firmware reserve the rest), so 4 x 120 GB = 480 GB, taken as the smaller, conservative figure. Each
# Hopper GPU reaches its Grace over NVLink-C2C, 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA
# GH200 datasheet, nominal; no effective figure is taken here). The C2C latency is not published: the
# loader's default for a host link (5 us) applies.
CLARIDEN_HOST: dict[str, Any] = {"cpu": "Grace", "sockets": 4, "memory": "480 GB",
                                 "pcie": {"bandwidth": "450 GB/s"}}


def _nodes(prefix: str, count: int, gpu_type: str, sailor_gpu: str, gpus_per_node: int,
           intra_kind: str, host: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``count`` servers of ``gpus_per_node`` GPUs with Sailor's measured intra-node and NIC links (and
    ``host`` as their host entry, if given)."""
    server: dict[str, Any] = {"gpus": [{"type": gpu_type, "count": gpus_per_node}],
                              "nic": _link(INTER_FILE, sailor_gpu, gpus_per_node, "nic")}
    if host is not None:
        server["host"] = host
    if gpus_per_node > 1:
        server["intra"] = _link(INTRA_FILE, sailor_gpu, gpus_per_node, intra_kind)
    return [{"name": f"{prefix}{i}", **server} for i in range(count)]


def clariden(nodes: int = 4) -> dict[str, Any]:
    """CSCS Alps Clariden: nodes of 4 GH200 (96 GB), NVLink 4 inside a node, HPE Slingshot-11 between nodes
    (4 x 200 Gbit/s Cassini NICs per node, CSCS documentation), measured by Sailor: 125 GB/s per GPU pair
    with all four GPUs busy, 92.6 GB/s per node between nodes. Host: ``CLARIDEN_HOST``."""
    return {"name": f"clariden:nodes={nodes}",
            "servers": _nodes("gh", nodes, "GH200-96GB", "GH-96", 4, "nvlink", CLARIDEN_HOST)}


def mit(rtx3090: int = 1, titan_rtx: int = 2, rtx2080: int = 3) -> dict[str, Any]:
    """The MIT cluster of Sailor's validation: servers of 8 GPUs on PCIe, one GPU type each (defaults: the
    testbed, k1 = RTX-3090, n2-n3 = Titan-RTX, r4-r6 = RTX-2080 in sailor/Planner/baselines/Aceso/
    scripts_mit/run_mit.sh). Sailor measured 6.1 GB/s per GPU pair inside the RTX-2080 and Titan-RTX nodes
    and 1.3 GB/s inside the RTX-3090 node with all 8 GPUs busy, 22.9 Gbit/s NICs on the RTX-2080 and
    Titan-RTX nodes and 0.92 Gbit/s on the RTX-3090 node. Sailor's "RTX-2080" has 11 GiB: the catalog's
    RTX-2080Ti (``heterog.cluster.catalog.SAILOR_NAMES``)."""
    servers = (_nodes("rtx3090-", rtx3090, sailor_type("RTX-3090"), "RTX-3090", 8, "pcie")
               + _nodes("titan-rtx-", titan_rtx, sailor_type("Titan-RTX"), "Titan-RTX", 8, "pcie")
               + _nodes("rtx2080-", rtx2080, sailor_type("RTX-2080"), "RTX-2080", 8, "pcie"))
    counts = {"rtx3090": rtx3090, "titan-rtx": titan_rtx, "rtx2080": rtx2080}
    return {"name": "mit:" + ",".join(f"{k}={v}" for k, v in counts.items() if v), "servers": servers}


def gcp_a100_v100(a100: int = 1, v100: int = 1, gpus_per_node: int = 4) -> dict[str, Any]:
    """Google Cloud zone us-central1-a: A100-40GB VMs (a2-highgpu, NVLink) and V100-16GB VMs (n1-standard,
    NVLink) of ``gpus_per_node`` GPUs (1, 2 or 4, the sizes Sailor measured; 4 in its planner runs, e.g.
    ae_scripts/planner/run_het.sh, and in sailor/Planner/simulations/configs/basic_cluster_config.json).
    Between an A100 and a V100 VM the slower NIC bounds a transfer, as Sailor's
    sailor/providers/gcp/model_heterogeneous.py takes the smaller of the two."""
    if gpus_per_node not in (1, 2, 4):
        raise ClusterError(f"cluster 'gcp-a100-v100': gpus_per_node must be 1, 2 or 4 (Sailor measured those), "
                           f"got {gpus_per_node}")
    servers = (_nodes("a100-", a100, "A100-40GB", "A100-40", gpus_per_node, "nvlink")
               + _nodes("v100-", v100, "V100-16GB", "V100-16", gpus_per_node, "nvlink"))
    return {"name": f"gcp-a100-v100:a100={a100},v100={v100},gpus_per_node={gpus_per_node}", "servers": servers}


# name -> (builder, option name -> builder keyword)
PUBLISHED: dict[str, tuple[Callable[..., dict[str, Any]], dict[str, str]]] = {
    "clariden": (clariden, {"nodes": "nodes"}),
    "mit": (mit, {"rtx3090": "rtx3090", "titan-rtx": "titan_rtx", "rtx2080": "rtx2080"}),
    "gcp-a100-v100": (gcp_a100_v100, {"a100": "a100", "v100": "v100", "gpus_per_node": "gpus_per_node"}),
}
SYNTAX = ("clariden[:nodes=N], mit[:rtx3090=A,titan-rtx=B,rtx2080=C], "
          "gcp-a100-v100[:a100=A,v100=B,gpus_per_node=1|2|4]")


def is_published(spec: str) -> bool:
    """True if ``spec`` names one of these clusters (with or without options)."""
    return spec.strip().split(":", 1)[0] in PUBLISHED


def published_cluster(spec: str) -> Cluster:
    """The cluster for ``name[:key=value,...]`` (options separated by ',' or ':'); ClusterError naming a bad
    option, with the syntax."""
    head, _, rest = spec.strip().partition(":")
    if head not in PUBLISHED:
        raise ClusterError(f"cluster {spec!r}: not one of {SYNTAX}")
    builder, options = PUBLISHED[head]
    kwargs: dict[str, int] = {}
    for opt in filter(None, (o.strip() for o in rest.replace(":", ",").split(","))):
        key, sep, value = (part.strip() for part in opt.partition("="))
        if not sep or key not in options or options[key] in kwargs:
            raise ClusterError(f"cluster {spec!r}: bad, unknown or repeated option {opt!r}; options of {head!r}: "
                               f"{', '.join(options)} (syntax: {SYNTAX})")
        try:
            count = int(value)
        except ValueError:
            raise ClusterError(f"cluster {spec!r}: option {key!r} must be an integer, got {value!r}") from None
        if count < 0:
            raise ClusterError(f"cluster {spec!r}: option {key!r} must be >= 0, got {count}")
        kwargs[options[key]] = count
    d = builder(**kwargs)
    if not d["servers"]:
        raise ClusterError(f"cluster {spec!r} has no servers; give at least one node")
    return cluster_from_dict(d, source=f"cluster {spec!r}", default_name=head)


__all__ = ["CLARIDEN_HOST", "PUBLISHED", "SAILOR_FITS", "alpha_beta", "clariden", "gcp_a100_v100", "is_published",
           "mit", "published_cluster"]
