"""Seeded random heterogeneous clusters to learn from: plausible servers of catalog GPUs (NVLink or PCIe
inside a server, 10-200 Gbit/s NICs between servers) with the host of a server of their generation,
built through the YAML loader's validation.

``generate_cluster(seed)`` always gives the same cluster for the same seed and settings; a policy that
trains on many of them (``agent.head=tokens``) sees clusters of every size and mix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from heterog.cluster.catalog import CATALOG, device_type
from heterog.cluster.loader import cluster_from_dict
from heterog.cluster.topology import Cluster
from heterog.errors import ClusterError

__all__ = ["GPU_TYPES", "HOST_OF_GPU", "ClusterSpace", "generate_cluster", "generate_cluster_dict",
           "generate_clusters", "server_host"]

# the types drawn from, fixed so that a seed keeps giving the same cluster as the catalog grows
GPU_TYPES: tuple[str, ...] = ("V100-16GB", "V100-32GB", "GTX-1080Ti", "P100-12GB", "T4", "A100-40GB", "A100-80GB",
                              "H100", "L4", "RTX-3090", "RTX-4090")
NVLINK_TYPES = frozenset({"V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100"})  # SXM boards
NVLINK_GBps = {"V100-16GB": 45.0, "V100-32GB": 45.0, "A100-40GB": 240.0, "A100-80GB": 240.0, "H100": 360.0}
PCIE_GBps = (12.0, 24.0)             # PCIe 3.0 and 4.0 x16, effective
NIC_Gbps = (10, 25, 40, 50, 100, 200)
# the host of a server by its GPUs' generation: (host CPU type, its PCIe generation's effective x16 GB/s
# per direction: 3.0 ~12, 4.0 ~24, 5.0 ~48 of 15.75 / 31.5 / 63 nominal). A V100-era server is a
# dual-socket Skylake-SP, an A100-era one a dual EPYC Rome (as the DGX A100), Ada/L4 a dual EPYC Milan,
# H100 a dual Sapphire Rapids (as the DGX H100)
HOST_OF_GPU: dict[str, tuple[str, float]] = {
    "V100-16GB": ("Xeon-Gold-6148", 12.0), "V100-32GB": ("Xeon-Gold-6148", 12.0),
    "GTX-1080Ti": ("Xeon-Gold-6148", 12.0), "P100-12GB": ("Xeon-Gold-6148", 12.0), "T4": ("Xeon-Gold-6148", 12.0),
    "A100-40GB": ("EPYC-7742", 24.0), "A100-80GB": ("EPYC-7742", 24.0), "RTX-3090": ("EPYC-7742", 24.0),
    "RTX-4090": ("EPYC-7763", 24.0), "L4": ("EPYC-7763", 24.0), "H100": ("Xeon-Platinum-8480+", 48.0),
}
HOST_SOCKETS = 2
HOST_MEMORY_GB = (192, 384, 512, 768, 1024, 1536, 2048)   # DIMM-population sizes of a dual-socket server


@dataclass(frozen=True)
class ClusterSpace:
    """The clusters :func:`generate_cluster` draws from; checks itself when built.

    Each server holds GPUs of one type, or (``mixed_server_p``) of two types on PCIe; NVLink joins a
    server's GPUs only when they are all of one SXM type (``nvlink_p`` of those servers).
    """

    min_gpus: int = 2
    """Fewest GPUs of a cluster."""
    max_gpus: int = 16
    """Most GPUs of a cluster."""
    max_servers: int = 6
    """Most servers of a cluster (at least one GPU each)."""
    max_gpus_per_server: int = 8
    """Most GPUs in one server."""
    heterogeneous: bool = True
    """At least two GPU types in every cluster of 2+ GPUs (when gpu_types has two)."""
    max_types: int = 3
    """Most GPU types in one cluster (a cluster draws a palette of 2 to max_types types first)."""
    gpu_types: tuple[str, ...] = GPU_TYPES
    """Catalog types to draw from."""
    min_nic_Gbps: float = 10.0
    """Slowest NIC between servers (Gbit/s), from NIC_Gbps."""
    max_nic_Gbps: float = 200.0
    """Fastest NIC between servers (Gbit/s), from NIC_Gbps."""
    mixed_server_p: float = 0.25
    """Probability that a server of 2+ GPUs holds two types."""
    nvlink_p: float = 0.7
    """Probability that a server of one SXM type uses NVLink (else PCIe)."""
    nics: tuple[int, ...] = field(init=False)
    """Derived: the NIC speeds within [min_nic_Gbps, max_nic_Gbps]."""

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.min_gpus <= self.max_gpus:
            problems.append(f"min_gpus={self.min_gpus} and max_gpus={self.max_gpus} need 1 <= min <= max")
        if self.max_servers < 1 or self.max_gpus_per_server < 1:
            problems.append(f"max_servers={self.max_servers} and max_gpus_per_server={self.max_gpus_per_server} "
                            f"must be at least 1")
        elif self.max_gpus > self.max_servers * self.max_gpus_per_server:
            problems.append(f"max_gpus={self.max_gpus} do not fit {self.max_servers} servers of "
                            f"{self.max_gpus_per_server} GPUs")
        unknown = [t for t in self.gpu_types if t not in CATALOG]
        if unknown or not self.gpu_types:
            problems.append(f"gpu_types {list(self.gpu_types)} must be a non-empty list of catalog types "
                            f"(unknown: {unknown})")
        nics = tuple(n for n in NIC_Gbps if self.min_nic_Gbps <= n <= self.max_nic_Gbps)
        if not nics:
            problems.append(f"no NIC speed of {list(NIC_Gbps)} Gbit/s lies in [{self.min_nic_Gbps}, "
                            f"{self.max_nic_Gbps}]")
        if self.max_types < 1:
            problems.append(f"max_types={self.max_types} must be at least 1")
        for name in ("mixed_server_p", "nvlink_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1]")
        if problems:
            raise ClusterError("bad cluster space: " + "; ".join(problems))
        object.__setattr__(self, "nics", nics)


def _split(rng: np.random.Generator, total: int, parts: int, cap: int | None = None) -> list[int]:
    """``total`` as ``parts`` positive integers of at most ``cap`` each (``parts <= total <= parts * cap``):
    one each, then the rest one at a time to a random part with room left."""
    counts = [1] * parts
    for _ in range(total - parts):
        room = [i for i, c in enumerate(counts) if cap is None or c < cap]
        counts[int(rng.choice(room))] += 1
    return counts


def _server(rng: np.random.Generator, space: ClusterSpace, index: int, n_gpus: int,
            mixed: bool | None = None) -> dict[str, Any]:
    """One server of ``n_gpus``; ``mixed``: force two types (True) or leave it to chance (None)."""
    types = [str(rng.choice(space.gpu_types))]
    two = rng.random() < space.mixed_server_p if mixed is None else mixed
    if n_gpus >= 2 and len(space.gpu_types) > 1 and two:
        types.append(str(rng.choice([t for t in space.gpu_types if t != types[0]])))
    counts = _split(rng, n_gpus, len(types))
    spec: dict[str, Any] = {"name": f"s{index}",
                            "gpus": [{"type": t, "count": c} for t, c in zip(types, counts)]}
    if n_gpus >= 2:
        if len(types) == 1 and types[0] in NVLINK_TYPES and rng.random() < space.nvlink_p:
            spec["intra"] = {"kind": "nvlink", "bandwidth": f"{NVLINK_GBps[types[0]]:g} GB/s"}
        else:
            spec["intra"] = {"kind": "pcie", "bandwidth": f"{rng.choice(PCIE_GBps):g} GB/s"}
    return spec


def server_host(gpus: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``host`` entry of a server of ``gpus`` (``[{type, count}]``), drawn from no random numbers:
    ``HOST_SOCKETS`` sockets of the CPU of its newest GPU type's generation (the type latest in
    ``HOST_OF_GPU``, which lists generations oldest first), PCIe of its oldest (a link runs at the older
    end's generation), and the smallest of ``HOST_MEMORY_GB`` that holds twice its GPUs' memory (DGX
    servers carry 2-4x). None (no host: no offloading) when no type of the server is in ``HOST_OF_GPU``."""
    known = [g["type"] for g in gpus if g["type"] in HOST_OF_GPU]
    if not known:
        return None
    newest = max(known, key=list(HOST_OF_GPU).index)
    pcie_GBps = min(HOST_OF_GPU[t][1] for t in known)
    gpu_bytes = sum(device_type(g["type"]).memory_bytes * int(g.get("count", 1)) for g in gpus)
    memory_GB = next((m for m in HOST_MEMORY_GB if m * 1e9 >= 2 * gpu_bytes), HOST_MEMORY_GB[-1])
    return {"cpu": HOST_OF_GPU[newest][0], "sockets": HOST_SOCKETS, "memory": f"{memory_GB} GB",
            "pcie": {"bandwidth": f"{pcie_GBps:g} GB/s"}}


def generate_cluster_dict(seed: int, space: ClusterSpace | None = None) -> dict[str, Any]:
    """The YAML form (``heterog.cluster.loader``) of the cluster of ``seed``: a palette of 2 to
    ``max_types`` GPU types, a GPU count in ``[min_gpus, max_gpus]`` split over 1 to ``max_servers``
    servers (at most ``max_gpus_per_server`` each); one NIC speed per server and, with several servers,
    a switch as fast as the fastest NIC."""
    space = space or ClusterSpace()
    rng = np.random.default_rng(seed)
    n_types = min(int(rng.integers(2, max(space.max_types, 2) + 1)), space.max_types, len(space.gpu_types))
    palette = tuple(str(t) for t in rng.choice(space.gpu_types, size=n_types, replace=False))
    space = ClusterSpace(**{**_fields(space), "gpu_types": palette})
    n_gpus = int(rng.integers(space.min_gpus, space.max_gpus + 1))
    fewest = -(-n_gpus // space.max_gpus_per_server)
    n_servers = int(rng.integers(fewest, min(space.max_servers, n_gpus) + 1))
    sizes = _split(rng, n_gpus, n_servers, space.max_gpus_per_server)
    servers = [_server(rng, space, j, n) for j, n in enumerate(sizes)]
    if space.heterogeneous and n_gpus >= 2 and len(space.gpu_types) > 1 and len(_types(servers)) == 1:
        # a homogeneous draw: the last server takes another type (or, alone, two types)
        only = _types(servers).pop()
        if n_servers > 1:
            other = ClusterSpace(**{**_fields(space), "gpu_types": tuple(t for t in space.gpu_types if t != only)})
            servers[-1] = _server(rng, other, n_servers - 1, sizes[-1], mixed=False)
        else:
            servers[0] = _server(rng, space, 0, n_gpus, mixed=True)
    for spec in servers:
        host = server_host(spec["gpus"])
        if host is not None:
            spec["host"] = host
    d: dict[str, Any] = {"name": f"gen-{seed}", "servers": servers}
    if n_servers > 1:
        nics = [int(rng.choice(space.nics)) for _ in servers]
        for spec, nic in zip(servers, nics):
            spec["nic"] = {"bandwidth": f"{nic} Gbit/s"}
        d["switch"] = {"bandwidth": f"{max(nics)} Gbit/s"}
    return d


def _types(servers: list[dict[str, Any]]) -> set[str]:
    return {g["type"] for spec in servers for g in spec["gpus"]}


def _fields(space: ClusterSpace) -> dict[str, Any]:
    return {name: getattr(space, name) for name in space.__dataclass_fields__ if name != "nics"}


def generate_cluster(seed: int, space: ClusterSpace | None = None) -> Cluster:
    """The cluster of ``seed`` (see :func:`generate_cluster_dict`), validated by the loader."""
    return cluster_from_dict(generate_cluster_dict(seed, space), source=f"generated cluster (seed {seed})")


def generate_clusters(n: int, seed: int = 0, space: ClusterSpace | None = None) -> list[Cluster]:
    """``n`` clusters of seeds ``seed, seed + 1, ...``."""
    if n < 0:
        raise ClusterError(f"the number of clusters must be at least 0, got {n}")
    return [generate_cluster(seed + i, space) for i in range(n)]
