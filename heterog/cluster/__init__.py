"""GPU clusters: the device catalog, the topology (servers, directed links, path tables) and the
YAML loader with the built-in clusters, including the HeteroG paper testbeds and local-cpu-N."""
from heterog.cluster.catalog import CATALOG, DeviceType
from heterog.cluster.loader import builtin_names, load_cluster
from heterog.cluster.topology import Cluster, Device, Link, Server

__all__ = ["CATALOG", "Cluster", "Device", "DeviceType", "Link", "Server", "builtin_names", "load_cluster"]
