"""Cluster topology: devices grouped in servers, the directed links between them, and precomputed
paths with their bottleneck bandwidth and latency (what transfers and collectives hold and pay).

Link model (every link is a directed resource: full duplex means a->b and b->a do not contend):

- Within a server, one link per ordered device pair (a->b), of the server's intra kind ("nvlink",
  "pcie" or "loopback") with the server's intra bandwidth and latency. Path a->b = (that link,).
- Each server with a NIC has two links, ``<server>/nic-out`` and ``<server>/nic-in``, with the NIC
  bandwidth and latency. A transfer from server S to server T holds (nic-out of S, nic-in of T);
  it passes a non-blocking switch of ``switch_bandwidth_Bps`` per port, which is not a contended
  resource but caps the rate. Bottleneck = min(nic-out bw, nic-in bw, switch bw); latency = sum of
  the two NIC latencies. Transfers that leave the same server contend on its nic-out.
- A device to itself: empty path, infinite bandwidth, zero latency.

Host side (``Server.host``, optional): the server's CPU sockets and memory, and the link of each GPU
to it (PCIe, or NVLink-C2C on a GH200). It is not a link of the table above: offloading prices it
directly (``heterog.cost.host``). A server without a host record cannot offload (its host memory
counts as 0 bytes). Storage (``Server.storage_bandwidth_Bps``): the rate at which the server's devices
together write a checkpoint to its storage; a cluster file may state it, the default is
``DEFAULT_STORAGE_BANDWIDTH_Bps``. A server whose NIC bandwidth is 0 has no NIC; with several servers that
makes the cluster disconnected, which is an error. Paths, bandwidths and latencies are tabulated once at
build time.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from heterog.cluster.catalog import DeviceType, HostCPUType
from heterog.errors import ClusterError

LINK_KINDS = ("nvlink", "pcie", "nic-out", "nic-in", "loopback")
# a server's storage write rate when its cluster file states none: the sequential write rate of one Intel SSD
# DC P4500 4 TB NVMe drive, 1.8 GB/s (Lenovo Press product guide "Intel P4500 Entry NVMe PCIe 3.0 SSDs",
# technical specifications, Table 2), a common data-centre drive of the paper's GPU generation
DEFAULT_STORAGE_BANDWIDTH_Bps = 1.8e9
INTRA_KINDS = ("nvlink", "pcie", "loopback")


@dataclass(frozen=True)
class Device:
    """One worker (GPU or emulated CPU worker); ``slowdown`` multiplies its compute times."""

    index: int
    name: str
    type: DeviceType
    server: int
    slowdown: float = 1.0


@dataclass(frozen=True)
class Link:
    """One directed communication resource; a transfer holds every link on its path."""

    index: int
    name: str
    bandwidth_Bps: float
    latency_s: float
    kind: str


@dataclass(frozen=True)
class Host:
    """A server's host side: ``sockets`` CPUs of one type, ``memory_bytes`` of host memory, and the link
    of each GPU to it (``pcie_bandwidth_Bps`` per direction, each GPU its own; ``pcie_latency_s``)."""

    cpu: HostCPUType
    sockets: int
    memory_bytes: int
    pcie_bandwidth_Bps: float
    pcie_latency_s: float

    def __post_init__(self) -> None:
        if isinstance(self.sockets, bool) or not isinstance(self.sockets, int) or self.sockets < 1:
            raise ClusterError(f"sockets: must be a positive integer, got {self.sockets!r}")
        if not self.memory_bytes > 0:
            raise ClusterError(f"memory: must be positive, got {self.memory_bytes} B")
        most = self.sockets * self.cpu.max_memory_bytes
        if self.memory_bytes > most:
            raise ClusterError(f"memory: {self.memory_bytes / 1e9:g} GB is more than {self.sockets} "
                               f"{self.cpu.name} socket(s) address ({most / 1e9:g} GB)")
        if not 0 < self.pcie_bandwidth_Bps < math.inf:
            raise ClusterError(f"pcie.bandwidth: must be positive and finite, got {self.pcie_bandwidth_Bps} B/s")
        if not 0 <= self.pcie_latency_s < math.inf:
            raise ClusterError(f"pcie.latency: must be >= 0, got {self.pcie_latency_s} s")

    @property
    def peak_flops(self) -> float:
        """fp32 FLOP/s of all sockets."""
        return self.sockets * self.cpu.peak_flops

    @property
    def memory_bandwidth_Bps(self) -> float:
        """Peak host memory bandwidth of all sockets."""
        return self.sockets * self.cpu.memory_bandwidth_Bps

    @property
    def effective_flops(self) -> float:
        """fp32 FLOP/s an optimizer step reaches on all sockets."""
        return self.sockets * self.cpu.effective_flops

    @property
    def effective_memory_Bps(self) -> float:
        """Host memory bandwidth a streaming kernel reaches on all sockets."""
        return self.sockets * self.cpu.effective_memory_Bps


@dataclass(frozen=True)
class Server:
    """A machine: its devices (global indices), intra-server interconnect, NIC (0 bandwidth = none), host
    side (None = not described: nothing can be offloaded to it) and storage write rate (checkpoints)."""

    index: int
    name: str
    devices: list[int]
    intra: str
    intra_bandwidth_Bps: float
    intra_latency_s: float
    nic_bandwidth_Bps: float = 0.0
    nic_latency_s: float = 0.0
    host: Host | None = None
    storage_bandwidth_Bps: float = DEFAULT_STORAGE_BANDWIDTH_Bps

    @property
    def has_nic(self) -> bool:
        return self.nic_bandwidth_Bps != 0


def build_links(servers: list[Server], devices: list[Device]) -> list[Link]:
    """The links of the model in the module docstring, numbered in a fixed order: per server, its
    intra links (row-major over ordered device pairs), then its nic-out and nic-in."""
    links: list[Link] = []
    for s in servers:
        for a in s.devices:
            for b in s.devices:
                if a != b:
                    links.append(Link(len(links), f"{devices[a].name}->{devices[b].name}",
                                      s.intra_bandwidth_Bps, s.intra_latency_s, s.intra))
        if s.has_nic:
            for kind in ("nic-out", "nic-in"):
                links.append(Link(len(links), f"{s.name}/{kind}", s.nic_bandwidth_Bps, s.nic_latency_s, kind))
    return links


@dataclass
class Cluster:
    """Devices, servers and links with path tables. Pass ``links=[]`` to derive the links from the
    servers; given links must be exactly the derived ones (names and kinds) and may differ in
    bandwidth or latency (a degraded link). Treat as immutable once built.

    Shapes: ``power``, ``memory_bytes``, ``server_of`` are ``(M,)``; ``bandwidth_Bps`` and
    ``latency_s`` are ``(M, M)``; ``path_table`` is ``(M, M, 2)`` link ids padded with -1.
    """

    name: str
    devices: list[Device]
    links: list[Link]
    servers: list[Server]
    switch_bandwidth_Bps: float = math.inf

    def __post_init__(self) -> None:
        self._check_layout()
        expected = build_links(self.servers, self.devices)
        if not self.links:
            self.links = expected
        else:
            self._check_links(expected)
        for link in self.links:
            if not link.bandwidth_Bps > 0:
                raise ClusterError(f"cluster {self.name!r}: link {link.name!r} has non-positive bandwidth "
                                   f"{link.bandwidth_Bps} B/s")
            if not link.latency_s >= 0:
                raise ClusterError(f"cluster {self.name!r}: link {link.name!r} has negative latency "
                                   f"{link.latency_s} s")
        self._build_paths()

    # ------------------------------------------------------------------ validation
    def _check_layout(self) -> None:
        if not self.devices:
            raise ClusterError(f"cluster {self.name!r} has no devices")
        if not self.servers:
            raise ClusterError(f"cluster {self.name!r} has no servers")
        for i, d in enumerate(self.devices):
            if d.index != i:
                raise ClusterError(f"cluster {self.name!r}: device {d.name!r} has index {d.index}, expected {i}")
            if not 0 <= d.server < len(self.servers):
                raise ClusterError(f"cluster {self.name!r}: device {d.name!r} is on missing server {d.server}")
            if not 0 < d.slowdown < math.inf:
                raise ClusterError(f"cluster {self.name!r}: device {d.name!r} has slowdown {d.slowdown}; "
                                   f"it must be a positive finite factor")
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ClusterError(f"cluster {self.name!r}: duplicate device names {', '.join(dup)}")
        seen_servers: set[str] = set()
        for j, s in enumerate(self.servers):
            if s.index != j:
                raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has index {s.index}, expected {j}")
            if s.name in seen_servers:
                raise ClusterError(f"cluster {self.name!r}: duplicate server name {s.name!r}")
            seen_servers.add(s.name)
            members = [d.index for d in self.devices if d.server == j]
            if sorted(s.devices) != members:
                raise ClusterError(f"cluster {self.name!r}: server {s.name!r} lists devices {list(s.devices)} "
                                   f"but devices {members} say they are on it")
            if len(s.devices) > 1:
                if s.intra not in INTRA_KINDS:
                    raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has unknown intra kind "
                                       f"{s.intra!r}; known: {', '.join(INTRA_KINDS)}")
                if not s.intra_bandwidth_Bps > 0:
                    raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has non-positive intra "
                                       f"bandwidth {s.intra_bandwidth_Bps} B/s")
                if not s.intra_latency_s >= 0:
                    raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has negative intra latency "
                                       f"{s.intra_latency_s} s")
            if s.nic_bandwidth_Bps < 0 or math.isnan(s.nic_bandwidth_Bps):
                raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has non-positive NIC bandwidth "
                                   f"{s.nic_bandwidth_Bps} B/s")
            if not s.nic_latency_s >= 0:
                raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has negative NIC latency "
                                   f"{s.nic_latency_s} s")
            if not 0 < s.storage_bandwidth_Bps < math.inf:
                raise ClusterError(f"cluster {self.name!r}: server {s.name!r} has storage bandwidth "
                                   f"{s.storage_bandwidth_Bps} B/s; it must be positive and finite")
        if len(self.servers) > 1:
            isolated = [s.name for s in self.servers if not s.has_nic]
            if isolated:
                raise ClusterError(f"cluster {self.name!r} is disconnected: servers {', '.join(isolated)} have no "
                                   f"NIC (bandwidth 0) and cannot reach the other servers")
            if not self.switch_bandwidth_Bps > 0:
                raise ClusterError(f"cluster {self.name!r}: switch bandwidth must be positive, got "
                                   f"{self.switch_bandwidth_Bps} B/s")

    def _check_links(self, expected: list[Link]) -> None:
        got = [(link.index, link.name, link.kind) for link in self.links]
        want = [(link.index, link.name, link.kind) for link in expected]
        if got != want:
            missing = sorted({w[1] for w in want} - {g[1] for g in got})
            extra = sorted({g[1] for g in got} - {w[1] for w in want})
            raise ClusterError(f"cluster {self.name!r}: links do not match its servers "
                               f"(missing {missing[:4]}, unexpected {extra[:4]}, or wrong order/kind)")

    # ------------------------------------------------------------------ path tables
    def _build_paths(self) -> None:
        m = len(self.devices)
        by_name = {link.name: link for link in self.links}
        table = np.full((m, m, 2), -1, dtype=np.int64)
        bw = np.full((m, m), np.inf)
        lat = np.zeros((m, m))
        paths: dict[tuple[int, int], tuple[int, ...]] = {}
        for a, da in enumerate(self.devices):
            for b, db in enumerate(self.devices):
                if a == b:
                    paths[(a, b)] = ()
                    continue
                hops: tuple[Link, ...]
                if da.server == db.server:
                    hops = (by_name[f"{da.name}->{db.name}"],)
                    bw[a, b] = hops[0].bandwidth_Bps
                else:
                    hops = (by_name[f"{self.servers[da.server].name}/nic-out"],
                            by_name[f"{self.servers[db.server].name}/nic-in"])
                    bw[a, b] = min(hops[0].bandwidth_Bps, hops[1].bandwidth_Bps, self.switch_bandwidth_Bps)
                lat[a, b] = sum(h.latency_s for h in hops)
                paths[(a, b)] = tuple(h.index for h in hops)
                table[a, b, :len(hops)] = paths[(a, b)]
        for arr in (table, bw, lat):
            arr.setflags(write=False)
        self._paths = paths
        self._path_links = table
        self._bandwidth_Bps = bw
        self._latency_s = lat

    # ------------------------------------------------------------------ queries
    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def n_links(self) -> int:
        return len(self.links)

    @cached_property
    def power(self) -> np.ndarray:
        """(M,) peak fp32 FLOP/s of each device divided by its slowdown."""
        return np.array([d.type.peak_flops / d.slowdown for d in self.devices], dtype=np.float64)

    @cached_property
    def memory_bytes(self) -> np.ndarray:
        """(M,) device memory capacity in bytes."""
        return np.array([d.type.memory_bytes for d in self.devices], dtype=np.float64)

    @cached_property
    def server_of(self) -> np.ndarray:
        """(M,) server index of each device."""
        return np.array([d.server for d in self.devices], dtype=np.int64)

    @cached_property
    def slowdown(self) -> np.ndarray:
        """(M,) compute slowdown factor of each device (1 = as the catalog says)."""
        return np.array([d.slowdown for d in self.devices], dtype=np.float64)

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def link_names(self) -> list[str]:
        return [link.name for link in self.links]

    def host_of(self, device: int) -> Host:
        """The host of ``device``'s server; ClusterError naming the device and server if it has none."""
        if not 0 <= int(device) < self.n_devices:
            raise ClusterError(f"cluster {self.name!r}: no device {device}; devices are 0..{self.n_devices - 1}")
        server = self.servers[self.devices[int(device)].server]
        if server.host is None:
            raise ClusterError(f"cluster {self.name!r}: server {server.name!r} of device "
                               f"{self.devices[int(device)].name!r} has no 'host:' entry; nothing can be "
                               f"offloaded to it")
        return server.host

    def host_memory_bytes(self, server: int) -> int:
        """Host memory of server ``server`` in bytes; 0 for a server without a host record (offloading to
        it is not possible)."""
        if not 0 <= int(server) < len(self.servers):
            raise ClusterError(f"cluster {self.name!r}: no server {server}; servers are 0..{len(self.servers) - 1}")
        host = self.servers[int(server)].host
        return 0 if host is None else host.memory_bytes

    def best_source(self, holders: Sequence[int], dst: int) -> int:
        """Of the devices ``holders``, the one a value is best moved from to ``dst``: the highest path
        bandwidth, then the lowest latency, then the lowest id."""
        bw, lat = self.bandwidth_Bps, self.latency_s
        return int(min(holders, key=lambda h: (-float(bw[h, dst]), float(lat[h, dst]), int(h))))

    def path(self, a: int, b: int) -> tuple[int, ...]:
        """Link ids a transfer from device ``a`` to device ``b`` holds (empty when a == b)."""
        try:
            return self._paths[(int(a), int(b))]
        except KeyError:
            raise ClusterError(f"cluster {self.name!r}: no device pair ({a}, {b}); "
                               f"devices are 0..{self.n_devices - 1}") from None

    @property
    def path_table(self) -> np.ndarray:
        """(M, M, 2) link ids of each path, padded with -1 (read-only)."""
        return self._path_links

    @property
    def bandwidth_Bps(self) -> np.ndarray:
        """(M, M) bottleneck bandwidth of each path in bytes/s, inf on the diagonal (read-only)."""
        return self._bandwidth_Bps

    @property
    def latency_s(self) -> np.ndarray:
        """(M, M) summed link latency of each path, 0 on the diagonal (read-only)."""
        return self._latency_s

    def __repr__(self) -> str:
        types: dict[str, int] = {}
        for d in self.devices:
            types[d.type.name] = types.get(d.type.name, 0) + 1
        mix = ", ".join(f"{n}x {t}" for t, n in types.items())
        return f"Cluster({self.name!r}: {mix}; {len(self.servers)} servers, {len(self.links)} links)"


def subset(cluster: Cluster, keep: Sequence[str], name: str | None = None, *, ordered: bool = False) -> Cluster:
    """The cluster of ``cluster``'s devices named in ``keep``, with their servers' links, hosts and storage
    (servers left without devices are dropped): in ``cluster``'s order, or with ``ordered`` in ``keep``'s
    (device i of the result is ``keep[i]``, as process rank i of a job names it). ``name`` defaults to
    ``cluster.name`` when the devices are all of ``cluster``'s in its order, else ``<name>[<devices>]``.
    ClusterError naming an unknown or repeated device, or when none is kept."""
    names = cluster.device_names
    unknown = sorted(set(keep) - set(names))
    repeated = sorted({d for d in keep if list(keep).count(d) > 1})
    if unknown or repeated:
        raise ClusterError(f"cluster {cluster.name!r} has no device {', '.join(map(repr, unknown))}; its devices: "
                           f"{', '.join(names)}" if unknown else f"devices named twice: {', '.join(repeated)}")
    by_name = {d.name: d for d in cluster.devices}
    kept = [by_name[n] for n in keep] if ordered else [d for d in cluster.devices if d.name in set(keep)]
    if not kept:
        raise ClusterError(f"cluster {cluster.name!r}: no device is left")
    if name is None:
        same = [d.name for d in kept] == names
        name = cluster.name if same else f"{cluster.name}[{','.join(d.name for d in kept)}]"
    server_ids = list(dict.fromkeys(d.server for d in kept))
    devices = [Device(i, d.name, d.type, server_ids.index(d.server), d.slowdown) for i, d in enumerate(kept)]
    servers = []
    for j, sid in enumerate(server_ids):
        s = cluster.servers[sid]
        servers.append(Server(j, s.name, [d.index for d in devices if d.server == j], s.intra, s.intra_bandwidth_Bps,
                              s.intra_latency_s, s.nic_bandwidth_Bps, s.nic_latency_s, s.host,
                              s.storage_bandwidth_Bps))
    links = {link.name: link for link in cluster.links}
    return Cluster(name, devices, [replace(link, bandwidth_Bps=links[link.name].bandwidth_Bps,
                                           latency_s=links[link.name].latency_s)
                                   for link in build_links(servers, devices)], servers, cluster.switch_bandwidth_Bps)
