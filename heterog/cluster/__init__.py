"""GPU clusters: the device catalog (GPUs and host CPUs), the topology (servers with their hosts, directed
links, path tables) and the YAML loader with the built-in clusters, including the HeteroG paper testbeds,
local-cpu-N and the clusters of Sailor's published runs (clariden, mit, gcp-a100-v100), and generated
clusters (gen-SEED)."""
import re
from pathlib import Path

from heterog.cluster import loader
from heterog.cluster.catalog import CATALOG, HOST_CATALOG, DeviceType, HostCPUType
from heterog.cluster.generate import generate_cluster
from heterog.cluster.loader import builtin_names
from heterog.cluster.published import is_published, published_cluster
from heterog.cluster.topology import Cluster, Device, Host, Link, Server


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A Cluster from a YAML file, a built-in name (``builtin_names()``), ``local-cpu-N[:...]``
    (``heterog.cluster.loader.load_cluster``), ``gen-SEED``: the generated cluster of that seed
    (``heterog.cluster.generate``), or a cluster of Sailor's runs with its options (``clariden:nodes=16``,
    ``heterog.cluster.published``)."""
    text = str(name_or_path).strip()
    generated = re.fullmatch(r"gen-(\d+)", text)
    if generated and not Path(text).is_file():
        return generate_cluster(int(generated.group(1)))
    if is_published(text) and not Path(text).is_file():
        return published_cluster(text)
    return loader.load_cluster(name_or_path)


__all__ = ["CATALOG", "HOST_CATALOG", "Cluster", "Device", "DeviceType", "Host", "HostCPUType", "Link", "Server",
           "builtin_names", "load_cluster"]
