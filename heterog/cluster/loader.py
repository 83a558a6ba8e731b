"""Cluster files: the YAML format, unit parsing, the built-in clusters (package data) and the
generated ``local-cpu-N`` clusters; ``load_cluster(name_or_path)`` is the one entry point.

YAML format::

    name: paper-8gpu
    switch: {bandwidth: 100 Gbit/s}             # optional; absent = non-blocking (no cap)
    servers:
      - name: s0                                 # optional; default s<i>
        gpus: [V100-16GB, V100-16GB]             # catalog names, or entries (below)
        intra: {kind: pcie, bandwidth: 12 GB/s, latency_us: 5}   # needed with 2+ GPUs
        nic: {bandwidth: 100 Gbit/s, latency_us: 10}             # needed with 2+ servers
        host: {cpu: Xeon-Gold-6148, sockets: 2, memory: 384 GB,   # optional; absent = no offloading
               pcie: {bandwidth: 12 GB/s, latency_us: 5}}
        storage: {bandwidth: 1.8 GB/s}           # optional; the rate checkpoints are written at

A GPU entry is a catalog name, ``{type: T, count: n, slowdown: x}`` (catalog type; any DeviceType
field given next to it overrides the catalog value), or an explicit type ``{name: N, peak_tflops: 15,
memory_bandwidth: 900 GB/s, memory: 16 GiB}`` (optional: tensor_tflops, compute_efficiency,
memory_efficiency, launch_overhead_us, count, slowdown). Bandwidths carry a unit (B/s, kB/s, MB/s,
GB/s, TB/s, KiB/s, MiB/s, GiB/s, kbit/s, Mbit/s, Gbit/s, Tbit/s, Kb/s, Mb/s, Gb/s, Tb/s, Mbps, Gbps);
memory carries one too (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB). Latencies are ``latency_us``
(or ``latency_s``); when absent: nvlink 2 us, pcie 5 us, loopback 20 us, NIC 10 us.

``host`` describes the server's host side (``topology.Host``): ``cpu`` a host CPU type of
``catalog.HOST_CATALOG``, ``sockets`` (default 1), ``memory`` the host memory with a unit, and ``pcie``
the link of each GPU to the host (``bandwidth`` per direction, each GPU its own; ``latency_us``, default
5). A server without ``host`` has no host record: nothing can be offloaded to it (its host memory counts
as 0 bytes), so offloading is possible only where a cluster file says what the host is.

``storage`` gives the rate at which the server's devices together write a checkpoint (``bandwidth``, what
the simulator's checkpoint term divides the bytes by); absent, ``topology.DEFAULT_STORAGE_BANDWIDTH_Bps``
(one data-centre NVMe drive's sequential write rate; the source is named there).

``local-cpu-N`` (any N >= 1) is generated, not a file: N devices of type ``cpu`` on one server
``localhost`` joined by loopback links (2 GB/s, 20 us). Options follow as ``:key=value``::

    local-cpu-3:slowdown=1,2,1:bandwidth=1GB/s:latency_us=50

``slowdown`` is one factor for all workers or one per worker (stored on Device.slowdown; the
runtime emulates it), ``bandwidth`` and ``latency_us`` set the loopback links (the runtime throttles
transfers to match). ``host=<host CPU type>`` describes the machine's host side, so that plans may offload
state to it (one socket, ``host_memory`` (default 16 GB) of memory, the loopback link's speed as each worker's
link to it): a worker's host memory and its own are one, which the runtime keeps apart as copies.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from heterog.cluster.catalog import CATALOG, DeviceType, device_type, host_cpu_type
from heterog.cluster.topology import INTRA_KINDS, Cluster, DEFAULT_STORAGE_BANDWIDTH_Bps, Device, Host, Server
from heterog.errors import ClusterError

BANDWIDTH_UNITS_Bps: dict[str, float] = {
    "B/s": 1.0, "kB/s": 1e3, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
    "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8,
}
MEMORY_UNITS_bytes: dict[str, float] = {
    "B": 1.0, "KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}
DEFAULT_LATENCY_US = {"nvlink": 2.0, "pcie": 5.0, "loopback": 20.0, "nic": 10.0}
LOOPBACK_BANDWIDTH_Bps = 2e9
LOOPBACK_LATENCY_S = 20e-6
LOCAL_CPU_PREFIX = "local-cpu"
LOCAL_CPU_SYNTAX = ("local-cpu-N[:slowdown=X|X1,...,XN][:bandwidth=<value><unit>][:latency_us=U]"
                    "[:host=<host CPU type>[:host_memory=<value><unit>]]")
LOCAL_CPU_HOST_MEMORY = "16 GB"

_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z/]*)\s*$")
# numeric GPU-entry keys: key -> (DeviceType field, conversion to the field's unit, must be > 0 (else >= 0))
_GPU_NUMBERS: dict[str, tuple[str, Callable[[float], float], bool]] = {
    "peak_tflops": ("peak_flops", lambda x: x * 1e12, True),
    "peak_flops": ("peak_flops", lambda x: x, True),
    "tensor_tflops": ("tensor_flops", lambda x: x * 1e12, True),
    "tensor_flops": ("tensor_flops", lambda x: x, True),
    "compute_efficiency": ("compute_efficiency", lambda x: x, True),
    "memory_efficiency": ("memory_efficiency", lambda x: x, True),
    "launch_overhead_us": ("launch_overhead_s", lambda x: x / 1e6, False),
    "launch_overhead_s": ("launch_overhead_s", lambda x: x, False),
}
_GPU_KEYS = {"type", "name", "count", "slowdown", "memory_bandwidth", "memory", "host_driven_comm", *_GPU_NUMBERS}


# ---------------------------------------------------------------------- units
def _quantity(value: Any, units: dict[str, float], what: str, where: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ClusterError(f"{where}: {what} must be a string like '{example}', got {value!r}")
    if not isinstance(value, str):
        raise ClusterError(f"{where}: {what} {value!r} has no unit; write e.g. '{example}'")
    m = _QUANTITY.match(value)
    if not m:
        raise ClusterError(f"{where}: {what} {value!r} is not '<number> <unit>' (e.g. '{example}')")
    number, unit = float(m.group(1)), m.group(2)
    if not unit:
        raise ClusterError(f"{where}: {what} {value!r} has no unit; write e.g. '{example}'")
    if unit not in units:
        raise ClusterError(f"{where}: {what} {value!r} has unknown unit {unit!r}; known: {', '.join(units)}")
    result = number * units[unit]
    if not result > 0 or not math.isfinite(result):
        raise ClusterError(f"{where}: {what} must be positive, got {value!r}")
    return result


def parse_bandwidth_Bps(value: Any, where: str) -> float:
    """'100 Gbit/s' -> 1.25e10. ClusterError naming ``where`` if the unit is missing or unknown."""
    return _quantity(value, BANDWIDTH_UNITS_Bps, "bandwidth", where, "12 GB/s")


def parse_memory_bytes(value: Any, where: str) -> int:
    """'16 GiB' -> 17179869184. ClusterError naming ``where`` if the unit is missing or unknown."""
    return round(_quantity(value, MEMORY_UNITS_bytes, "memory", where, "16 GiB"))


def _number(value: Any, where: str, *, positive: bool = False, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: expected a number, got {value!r}")
    x = float(value)
    if math.isnan(x) or (positive and not x > 0) or (minimum is not None and x < minimum):
        need = "positive" if positive else f">= {minimum}"
        raise ClusterError(f"{where}: must be {need}, got {value!r}")
    return x


def _short(x: float) -> int | float:
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else x


def _exact(value: float, factor: float, divide: bool = False) -> int | float | None:
    """A short number y with y * factor == value (or y / factor == value when ``divide``), else None."""
    raw = value * factor if divide else value / factor
    for digits in range(13):
        y = round(raw, digits)
        if (y / factor if divide else y * factor) == value:
            return _short(y)
    return _short(raw) if (raw / factor if divide else raw * factor) == value else None


def _format_quantity(value: float, preferred: tuple[str, ...], units: dict[str, float], base: str) -> str:
    for unit in preferred:
        y = _exact(value, units[unit])
        if y is not None:
            return f"{y} {unit}"
    return f"{_short(value)} {base}"


def _latency(spec: dict, where: str, default_us: float) -> float:
    if "latency_us" in spec and "latency_s" in spec:
        raise ClusterError(f"{where}: give latency_us or latency_s, not both")
    if "latency_s" in spec:
        return _number(spec["latency_s"], f"{where}.latency_s", minimum=0.0)
    return _number(spec.get("latency_us", default_us), f"{where}.latency_us", minimum=0.0) / 1e6


def _latency_entry(latency_s: float) -> dict[str, int | float]:
    us = _exact(latency_s, 1e6, divide=True)
    return {"latency_us": us} if us is not None else {"latency_s": _short(latency_s)}


def _check_keys(spec: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                           f"allowed: {', '.join(sorted(allowed))}")


# ---------------------------------------------------------------------- dict -> Cluster
def _checked(build: Callable[[], DeviceType], where: str) -> DeviceType:
    """``build()``, with ``where`` put in front of the message of a ClusterError it raises."""
    try:
        return build()
    except ClusterError as exc:
        raise ClusterError(f"{where}: {exc}") from None


def _gpu_entry(entry: Any, where: str) -> tuple[DeviceType, int, float]:
    """(device type, count, slowdown) of one item of a server's ``gpus`` list."""
    if isinstance(entry, str):
        return _checked(lambda: device_type(entry), where), 1, 1.0
    if not isinstance(entry, dict):
        raise ClusterError(f"{where}: a GPU entry is a type name or a mapping, got {entry!r}")
    _check_keys(entry, _GPU_KEYS, where)
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ClusterError(f"{where}.count: must be a positive integer, got {count!r}")
    slowdown = _number(entry.get("slowdown", 1.0), f"{where}.slowdown", positive=True)
    over: dict[str, Any] = {}
    for key, (field_name, convert, positive) in _GPU_NUMBERS.items():
        if key not in entry:
            continue
        if field_name in over:
            raise ClusterError(f"{where}: {field_name} given twice (in two units)")
        if field_name == "tensor_flops" and entry[key] is None:
            over[field_name] = None
            continue
        value = _number(entry[key], f"{where}.{key}", positive=positive, minimum=None if positive else 0.0)
        over[field_name] = convert(value)
    if "memory_bandwidth" in entry:
        over["memory_bandwidth_Bps"] = parse_bandwidth_Bps(entry["memory_bandwidth"], f"{where}.memory_bandwidth")
    if "memory" in entry:
        over["memory_bytes"] = parse_memory_bytes(entry["memory"], f"{where}.memory")
    if "host_driven_comm" in entry:
        if not isinstance(entry["host_driven_comm"], bool):
            raise ClusterError(f"{where}.host_driven_comm: must be true or false, got {entry['host_driven_comm']!r}")
        over["host_driven_comm"] = entry["host_driven_comm"]
    if "type" in entry:
        base = _checked(lambda: device_type(entry["type"]), f"{where}.type")
        if "name" in entry:
            over["name"] = str(entry["name"])
        return _checked(lambda: replace(base, **over), where), count, slowdown
    if "name" not in entry:
        raise ClusterError(f"{where}: a GPU mapping needs 'type' (a catalog name) or 'name' plus "
                           f"peak_tflops, memory_bandwidth and memory")
    missing = [k for k, f in (("peak_tflops", "peak_flops"), ("memory_bandwidth", "memory_bandwidth_Bps"),
                              ("memory", "memory_bytes")) if f not in over]
    if missing:
        raise ClusterError(f"{where}: explicit device type {entry['name']!r} lacks {', '.join(missing)}")
    over.setdefault("tensor_flops", None)
    return _checked(lambda: DeviceType(name=str(entry["name"]), **over), where), count, slowdown


def _host_entry(spec: Any, where: str) -> Host:
    """The ``host`` entry of a server (module docstring); ``where`` names the server."""
    where = f"{where}.host"
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: must be a mapping with cpu, memory and pcie, got {spec!r}")
    _check_keys(spec, {"cpu", "sockets", "memory", "pcie"}, where)
    for key in ("cpu", "memory", "pcie"):
        if key not in spec:
            raise ClusterError(f"{where}: {key!r} is missing")
    try:
        cpu = host_cpu_type(spec["cpu"])
    except ClusterError as exc:
        raise ClusterError(f"{where}.cpu: {exc}") from None
    sockets = spec.get("sockets", 1)
    if isinstance(sockets, bool) or not isinstance(sockets, int) or sockets < 1:
        raise ClusterError(f"{where}.sockets: must be a positive integer, got {sockets!r}")
    memory_bytes = parse_memory_bytes(spec["memory"], f"{where}.memory")
    pcie = spec["pcie"]
    if not isinstance(pcie, dict) or "bandwidth" not in pcie:
        raise ClusterError(f"{where}.pcie: must be a mapping with 'bandwidth', got {pcie!r}")
    _check_keys(pcie, {"bandwidth", "latency_us", "latency_s"}, f"{where}.pcie")
    pcie_Bps = parse_bandwidth_Bps(pcie["bandwidth"], f"{where}.pcie.bandwidth")
    pcie_latency_s = _latency(pcie, f"{where}.pcie", DEFAULT_LATENCY_US["pcie"])
    try:
        return Host(cpu, sockets, memory_bytes, pcie_Bps, pcie_latency_s)
    except ClusterError as exc:
        raise ClusterError(f"{where}.{exc}") from None


def cluster_from_dict(d: Any, source: str = "<dict>", default_name: str = "cluster") -> Cluster:
    """Build a Cluster from the YAML form. Every error names ``source`` and the offending field."""
    if not isinstance(d, dict):
        raise ClusterError(f"{source}: a cluster file is a mapping with 'servers', got {type(d).__name__}")
    _check_keys(d, {"name", "switch", "servers"}, source)
    name = str(d.get("name", default_name))
    servers_spec = d.get("servers")
    if not isinstance(servers_spec, list) or not servers_spec:
        raise ClusterError(f"{source}: 'servers' must be a non-empty list")
    switch_Bps = math.inf
    if d.get("switch") is not None:
        sw = d["switch"]
        if not isinstance(sw, dict) or "bandwidth" not in sw:
            raise ClusterError(f"{source}: switch must be a mapping with 'bandwidth'")
        _check_keys(sw, {"bandwidth"}, f"{source}: switch")
        switch_Bps = parse_bandwidth_Bps(sw["bandwidth"], f"{source}: switch.bandwidth")

    devices: list[Device] = []
    servers: list[Server] = []
    for j, spec in enumerate(servers_spec):
        where = f"{source}: servers[{j}]"
        if not isinstance(spec, dict):
            raise ClusterError(f"{where}: a server is a mapping, got {spec!r}")
        _check_keys(spec, {"name", "gpus", "intra", "nic", "host", "storage"}, where)
        sname = str(spec.get("name", f"s{j}"))
        gpus = spec.get("gpus")
        if not isinstance(gpus, list) or not gpus:
            raise ClusterError(f"{where} ({sname}): 'gpus' must be a non-empty list")
        members: list[int] = []
        for k, entry in enumerate(gpus):
            dtype, count, slowdown = _gpu_entry(entry, f"{where}.gpus[{k}]")
            for _ in range(count):
                prefix = "cpu" if dtype.name == "cpu" else "gpu"
                devices.append(Device(len(devices), f"{sname}/{prefix}{len(members)}", dtype, j, slowdown))
                members.append(len(devices) - 1)

        intra = spec.get("intra")
        if intra is None:
            if len(members) > 1:
                raise ClusterError(f"{where} ({sname}): 'intra' (kind, bandwidth) is needed with "
                                   f"{len(members)} GPUs")
            kind, intra_Bps, intra_lat_s = "pcie", math.inf, 0.0
        else:
            if not isinstance(intra, dict):
                raise ClusterError(f"{where}.intra: must be a mapping with kind and bandwidth")
            _check_keys(intra, {"kind", "bandwidth", "latency_us", "latency_s"}, f"{where}.intra")
            kind = intra.get("kind", "pcie")
            if kind not in INTRA_KINDS:
                raise ClusterError(f"{where}.intra.kind: unknown kind {kind!r}; known: {', '.join(INTRA_KINDS)}")
            if "bandwidth" not in intra:
                raise ClusterError(f"{where}.intra: 'bandwidth' is missing")
            intra_Bps = parse_bandwidth_Bps(intra["bandwidth"], f"{where}.intra.bandwidth")
            intra_lat_s = _latency(intra, f"{where}.intra", DEFAULT_LATENCY_US[kind])

        nic = spec.get("nic")
        nic_Bps, nic_lat_s = 0.0, 0.0
        if nic is not None:
            if not isinstance(nic, dict) or "bandwidth" not in nic:
                raise ClusterError(f"{where}.nic: must be a mapping with 'bandwidth'")
            _check_keys(nic, {"bandwidth", "latency_us", "latency_s"}, f"{where}.nic")
            nic_Bps = parse_bandwidth_Bps(nic["bandwidth"], f"{where}.nic.bandwidth")
            nic_lat_s = _latency(nic, f"{where}.nic", DEFAULT_LATENCY_US["nic"])
        host = None if spec.get("host") is None else _host_entry(spec["host"], where)
        storage_Bps = DEFAULT_STORAGE_BANDWIDTH_Bps
        if spec.get("storage") is not None:
            storage = spec["storage"]
            if not isinstance(storage, dict) or "bandwidth" not in storage:
                raise ClusterError(f"{where}.storage: must be a mapping with 'bandwidth'")
            _check_keys(storage, {"bandwidth"}, f"{where}.storage")
            storage_Bps = parse_bandwidth_Bps(storage["bandwidth"], f"{where}.storage.bandwidth")
        servers.append(Server(j, sname, members, kind, intra_Bps, intra_lat_s, nic_Bps, nic_lat_s, host,
                              storage_Bps))
    try:
        return Cluster(name, devices, [], servers, switch_Bps)
    except ClusterError as exc:
        raise ClusterError(f"{source}: {exc}") from None


# ---------------------------------------------------------------------- Cluster -> dict
def _type_entry(t: DeviceType) -> dict[str, Any]:
    peak = _exact(t.peak_flops, 1e12)
    out: dict[str, Any] = {"name": t.name}
    out.update({"peak_tflops": peak} if peak is not None else {"peak_flops": t.peak_flops})
    if t.tensor_flops is not None:
        tensor = _exact(t.tensor_flops, 1e12)
        out.update({"tensor_tflops": tensor} if tensor is not None else {"tensor_flops": t.tensor_flops})
    out["memory_bandwidth"] = _format_quantity(t.memory_bandwidth_Bps, ("GB/s",), BANDWIDTH_UNITS_Bps, "B/s")
    out["memory"] = _format_quantity(float(t.memory_bytes), ("GiB", "GB"), MEMORY_UNITS_bytes, "B")
    out["compute_efficiency"] = t.compute_efficiency
    out["memory_efficiency"] = t.memory_efficiency
    launch = _exact(t.launch_overhead_s, 1e6, divide=True)
    out.update({"launch_overhead_us": launch} if launch is not None else {"launch_overhead_s": t.launch_overhead_s})
    if t.host_driven_comm:
        out["host_driven_comm"] = True
    return out


def _gpus_list(cluster: Cluster, server: Server) -> list[Any]:
    runs: list[tuple[DeviceType, float, int]] = []
    for i in server.devices:
        d = cluster.devices[i]
        if runs and runs[-1][0] == d.type and runs[-1][1] == d.slowdown:
            runs[-1] = (d.type, d.slowdown, runs[-1][2] + 1)
        else:
            runs.append((d.type, d.slowdown, 1))
    out: list[Any] = []
    for t, slowdown, count in runs:
        entry: dict[str, Any] = {"type": t.name} if CATALOG.get(t.name) == t else _type_entry(t)
        if slowdown != 1.0:
            entry["slowdown"] = _short(slowdown)
        if list(entry) == ["type"]:
            out.extend([t.name] * count)
            continue
        if count > 1:
            entry["count"] = count
        out.append(entry)
    return out


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The YAML form of ``cluster``; numbers are written in units that read back exactly."""
    out: dict[str, Any] = {"name": cluster.name}
    if math.isfinite(cluster.switch_bandwidth_Bps):
        out["switch"] = {"bandwidth": _format_quantity(cluster.switch_bandwidth_Bps, ("Gbit/s", "GB/s"),
                                                       BANDWIDTH_UNITS_Bps, "B/s")}
    servers = []
    for s in cluster.servers:
        entry: dict[str, Any] = {"name": s.name, "gpus": _gpus_list(cluster, s)}
        if 0 < s.intra_bandwidth_Bps < math.inf:
            entry["intra"] = {"kind": s.intra,
                              "bandwidth": _format_quantity(s.intra_bandwidth_Bps, ("GB/s", "Gbit/s"),
                                                            BANDWIDTH_UNITS_Bps, "B/s"),
                              **_latency_entry(s.intra_latency_s)}
        if s.has_nic:
            entry["nic"] = {"bandwidth": _format_quantity(s.nic_bandwidth_Bps, ("Gbit/s", "GB/s"),
                                                          BANDWIDTH_UNITS_Bps, "B/s"),
                            **_latency_entry(s.nic_latency_s)}
        if s.host is not None:
            entry["host"] = {"cpu": s.host.cpu.name, "sockets": s.host.sockets,
                             "memory": _format_quantity(float(s.host.memory_bytes), ("GB", "GiB"),
                                                        MEMORY_UNITS_bytes, "B"),
                             "pcie": {"bandwidth": _format_quantity(s.host.pcie_bandwidth_Bps, ("GB/s", "Gbit/s"),
                                                                    BANDWIDTH_UNITS_Bps, "B/s"),
                                      **_latency_entry(s.host.pcie_latency_s)}}
        if s.storage_bandwidth_Bps != DEFAULT_STORAGE_BANDWIDTH_Bps:
            entry["storage"] = {"bandwidth": _format_quantity(s.storage_bandwidth_Bps, ("GB/s", "Gbit/s"),
                                                              BANDWIDTH_UNITS_Bps, "B/s")}
        servers.append(entry)
    out["servers"] = servers
    return out


def save_cluster_yaml(cluster: Cluster, path: str | Path) -> Path:
    """Write the YAML form of ``cluster`` atomically (temporary file, then rename); ``load_cluster`` reads
    it back equal."""
    from heterog.atomic import atomic_write

    text = yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False, default_flow_style=None)
    return atomic_write(path, lambda f: f.write(text))


# ---------------------------------------------------------------------- local-cpu-N
def local_cpu_cluster(spec: str) -> Cluster:
    """The generated cluster for ``local-cpu-N[:key=value...]`` (syntax in the module docstring)."""
    head, *options = spec.strip().split(":")
    m = re.fullmatch(r"local-cpu-(\d+)", head)
    if not m or int(m.group(1)) < 1:
        raise ClusterError(f"cluster {spec!r}: expected {LOCAL_CPU_SYNTAX} with N >= 1")
    n = int(m.group(1))
    slowdowns = [1.0] * n
    bandwidth_Bps, latency_s = LOOPBACK_BANDWIDTH_Bps, LOOPBACK_LATENCY_S
    host: dict[str, Any] = {}
    seen: set[str] = set()
    for opt in options:
        key, sep, value = opt.partition("=")
        key, value = key.strip(), value.strip()
        where = f"cluster {spec!r}: option {key!r}"
        if not sep or key in seen:
            raise ClusterError(f"cluster {spec!r}: bad or repeated option {opt!r}; syntax: {LOCAL_CPU_SYNTAX}")
        seen.add(key)
        if key == "slowdown":
            try:
                values = [float(v) for v in value.split(",")]
            except ValueError:
                raise ClusterError(f"{where}: {value!r} is not a list of numbers") from None
            if len(values) not in (1, n):
                raise ClusterError(f"{where}: {len(values)} factors for {n} workers (give 1 or {n})")
            if not all(0 < v < math.inf for v in values):
                raise ClusterError(f"{where}: factors must be positive, got {value!r}")
            slowdowns = values * n if len(values) == 1 else values
        elif key == "bandwidth":
            bandwidth_Bps = parse_bandwidth_Bps(value, where)
        elif key == "latency_us":
            try:
                latency_s = _number(float(value), where, minimum=0.0) / 1e6
            except ValueError:
                raise ClusterError(f"{where}: {value!r} is not a number") from None
        elif key in ("host", "host_memory"):
            host["cpu" if key == "host" else "memory"] = value
        else:
            raise ClusterError(f"cluster {spec!r}: unknown option {key!r}; syntax: {LOCAL_CPU_SYNTAX}")
    if "memory" in host and "cpu" not in host:
        raise ClusterError(f"cluster {spec!r}: host_memory needs host=<host CPU type>")
    host_side = None if not host else _host_entry(
        {"cpu": host["cpu"], "memory": host.get("memory", LOCAL_CPU_HOST_MEMORY),
         "pcie": {"bandwidth": f"{bandwidth_Bps} B/s", "latency_s": latency_s}}, f"cluster {spec!r}: localhost")
    cpu = device_type("cpu")
    devices = [Device(i, f"localhost/cpu{i}", cpu, 0, slowdowns[i]) for i in range(n)]
    server = Server(0, "localhost", list(range(n)), "loopback", bandwidth_Bps, latency_s, host=host_side)
    return Cluster(spec.strip(), devices, [], [server])


# ---------------------------------------------------------------------- entry points
def _builtin_dir() -> Any:
    return resources.files("heterog.cluster").joinpath("builtin")


def builtin_names() -> list[str]:
    """Names of the built-in cluster files (``local-cpu-N`` clusters are generated, not listed)."""
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def _parse_yaml(text: str, source: str, default_name: str) -> Cluster:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterError(f"{source}: not valid YAML ({first})") from None
    return cluster_from_dict(data, source=source, default_name=default_name)


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A Cluster from a YAML file, a built-in name (``builtin_names()``) or ``local-cpu-N[:...]``
    (``heterog.cluster.load_cluster`` also takes ``gen-SEED``)."""
    text = str(name_or_path).strip()
    if text.startswith(LOCAL_CPU_PREFIX + "-") and not Path(text).is_file():
        return local_cpu_cluster(text)
    path = Path(text)
    if path.is_file():
        try:
            content = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterError(f"cluster file {text!r} cannot be read ({type(exc).__name__})") from None
        return _parse_yaml(content, f"cluster file {text!r}", path.stem)
    names = builtin_names()
    if text in names:
        content = _builtin_dir().joinpath(f"{text}.yaml").read_text()
        return _parse_yaml(content, f"built-in cluster {text!r}", text)
    raise ClusterError(f"unknown cluster {text!r}: not a file and not a built-in; built-ins: "
                       f"{', '.join(names)}, {LOCAL_CPU_SYNTAX}, gen-SEED, clariden, mit, gcp-a100-v100 "
                       f"(heterog.cluster.published)")


__all__ = [
    "builtin_names",
    "cluster_from_dict",
    "cluster_to_dict",
    "save_cluster_yaml",
    "load_cluster",
    "local_cpu_cluster",
    "parse_bandwidth_Bps",
    "parse_memory_bytes",
]
