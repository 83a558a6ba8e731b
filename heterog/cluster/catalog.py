"""Device catalog: datasheet peaks and roofline efficiencies of the GPU types (and a CPU worker)
that clusters are built from, and of the host CPUs of their servers (``HOST_CATALOG``: where offloaded
optimizer state lives and is updated); the cost model reads compute and memory speed from here.

Numbers are the vendors' published peaks: fp32 FLOP/s (``peak_flops``), dense fp16/bf16
tensor-core FLOP/s (``tensor_flops``, None where the chip has no tensor cores), DRAM bandwidth and
capacity. The efficiencies are the fraction of those peaks that training kernels (cuBLAS GEMMs and
cuDNN convolutions at training shapes, elementwise/normalisation kernels) typically reach, not the
best-case microbenchmark; ``launch_overhead_s`` is the fixed cost per op (launch plus ramp-up).

Calibration against the HeteroG paper. The paper measures per-op speed-ups of V100 over
GTX-1080Ti between about 1.1x and 1.9x depending on the op. The datasheets already separate the two
kinds of op: 15.7 vs 11.34 TFLOP/s (1.38x) for compute and 900 vs 484 GB/s (1.86x) for memory.
The efficiencies keep that separation and place it inside the paper's range:

- compute-bound (large GEMM/conv): V100 0.72 x 15.7 = 11.3 TFLOP/s vs 1080Ti 0.70 x 11.34 = 7.9 TFLOP/s,
  ratio 1.42x (Volta's larger L2 and register file let cuBLAS stay closer to peak than Pascal);
- memory-bound (elementwise, norms): V100 0.80 x 900 = 720 GB/s vs 1080Ti 0.82 x 484 = 397 GB/s,
  ratio 1.81x (HBM2 streams at a slightly lower fraction of its nominal rate than GDDR5X);
- launch-bound (tiny ops): 5.0 vs 5.5 us, ratio 1.1x, the paper's lower end.

Other types follow the same reasoning: power-limited cards (T4 at 70 W, L4 at 72 W) and consumer
Ampere/Ada cards (whose fp32 peak counts dual-issue FMA that GEMMs rarely sustain) get lower compute
efficiency. These are priors; the profiler's measured tables override them per op (heterog.cost).
Turing cards (T4, RTX-2080, RTX-2080Ti, Titan-RTX) share one prior, the T4's, and the GH200's Hopper
GPU the H100's; none is fitted to measured iteration times.

Other systems name the same parts differently; ``ALIASES`` maps their names (Sailor's and Metis'
plan and profile files: "GH-96", "A100-40", ...) to catalog names, and ``device_type`` accepts both.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from heterog.errors import ClusterError

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator (or CPU worker) as the roofline model sees it."""

    name: str
    peak_flops: float                  # fp32 FLOP/s (datasheet)
    tensor_flops: float | None         # dense fp16/bf16 tensor-core FLOP/s, None without tensor cores
    memory_bandwidth_Bps: float        # DRAM bandwidth, bytes/s (datasheet)
    memory_bytes: int                  # device memory capacity
    compute_efficiency: float = 0.7    # fraction of peak FLOP/s reached by training kernels
    memory_efficiency: float = 0.8     # fraction of peak bandwidth reached by streaming kernels
    launch_overhead_s: float = 5e-6    # fixed time per op
    host_driven_comm: bool = False     # its own cores move and reduce bytes (a CPU worker): communication
                                       # and computation on it do not overlap

    def __post_init__(self) -> None:
        checks = (
            ("peak_flops", self.peak_flops),
            ("memory_bandwidth_Bps", self.memory_bandwidth_Bps),
            ("memory_bytes", self.memory_bytes),
        )
        for field_name, value in checks:
            if not value > 0:
                raise ClusterError(f"device type {self.name!r}: {field_name} must be positive, got {value}")
        if self.tensor_flops is not None and not self.tensor_flops > 0:
            raise ClusterError(f"device type {self.name!r}: tensor_flops must be positive or None, "
                               f"got {self.tensor_flops}")
        for field_name, value in (("compute_efficiency", self.compute_efficiency),
                                  ("memory_efficiency", self.memory_efficiency)):
            if not 0 < value <= 1:
                raise ClusterError(f"device type {self.name!r}: {field_name} must be in (0, 1], got {value}")
        if not self.launch_overhead_s >= 0:
            raise ClusterError(f"device type {self.name!r}: launch_overhead_s must be >= 0, "
                               f"got {self.launch_overhead_s}")

    @property
    def effective_flops(self) -> float:
        """fp32 FLOP/s a training kernel reaches (peak x compute efficiency)."""
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_tensor_flops(self) -> float:
        """fp16/bf16 FLOP/s reached (tensor cores where present, else the fp32 rate)."""
        peak = self.tensor_flops if self.tensor_flops is not None else self.peak_flops
        return peak * self.compute_efficiency

    @property
    def effective_memory_Bps(self) -> float:
        """Bytes/s a streaming kernel reaches (peak x memory efficiency)."""
        return self.memory_bandwidth_Bps * self.memory_efficiency


def _t(name: str, tflops: float, tensor_tflops: float | None, mem_GBps: float, mem_GiB: float,
       ce: float, me: float, launch_us: float, host_driven_comm: bool = False) -> DeviceType:
    return DeviceType(name=name, peak_flops=tflops * 1e12,
                      tensor_flops=None if tensor_tflops is None else tensor_tflops * 1e12,
                      memory_bandwidth_Bps=mem_GBps * 1e9, memory_bytes=int(mem_GiB * GiB),
                      compute_efficiency=ce, memory_efficiency=me, launch_overhead_s=launch_us * 1e-6,
                      host_driven_comm=host_driven_comm)


_TYPES = (
    #   name          fp32 TF  tensor TF  GB/s    GiB  comp  mem   launch us
    _t("V100-16GB",   15.7,    125.0,     900.0,  16, 0.72, 0.80, 5.0),   # SXM2
    _t("V100-32GB",   15.7,    125.0,     900.0,  32, 0.72, 0.80, 5.0),   # SXM2
    _t("GTX-1080Ti",  11.34,   None,      484.0,  11, 0.70, 0.82, 5.5),
    _t("P100-12GB",   9.3,     None,      549.0,  12, 0.70, 0.78, 5.5),   # PCIe; fp16 is 2x, not tensor cores
    _t("T4",          8.1,     65.0,      320.0,  16, 0.60, 0.75, 5.0),   # 70 W, clocks drop under load
    _t("A100-40GB",   19.5,    312.0,     1555.0, 40, 0.75, 0.85, 4.0),   # SXM4
    _t("A100-80GB",   19.5,    312.0,     2039.0, 80, 0.75, 0.85, 4.0),   # SXM4
    _t("H100",        67.0,    989.0,     3350.0, 80, 0.70, 0.85, 4.0),   # SXM5 80GB
    _t("L4",          30.3,    121.0,     300.0,  24, 0.55, 0.80, 5.0),   # 72 W
    _t("RTX-3090",    35.6,    71.0,      936.0,  24, 0.55, 0.80, 5.0),   # fp32 peak counts dual-issue
    _t("RTX-4090",    82.6,    165.2,     1008.0, 24, 0.55, 0.80, 5.0),   # fp16 tensor with fp32 accumulate
    # GH200 Grace Hopper superchip, 96 GB HBM3 (NVIDIA GH200 datasheet, 2023): its Hopper GPU has the
    # H100 SXM5's peaks (67 TFLOP/s fp32, 989 TFLOP/s dense bf16) and 4.0 TB/s of HBM3; H100 priors
    _t("GH200-96GB",  67.0,    989.0,     4000.0, 96, 0.70, 0.85, 4.0),
    # H200 SXM (NVIDIA H200 datasheet, 2024): the H100 SXM5's compute (67 TFLOP/s fp32, 989 TFLOP/s dense
    # bf16) with 141 GB of HBM3e at 4.8 TB/s; H100 priors
    _t("H200",        67.0,    989.0,     4800.0, 141, 0.70, 0.85, 4.0),
    # Turing GeForce/Titan (NVIDIA Turing architecture whitepaper, 2018, appendix A, reference clocks):
    # fp16 tensor with fp32 accumulate (half rate on GeForce, full rate on Titan RTX); T4's priors
    _t("RTX-2080",    10.07,   40.3,      448.0,  8,  0.60, 0.75, 5.0),
    _t("RTX-2080Ti",  13.45,   53.8,      616.0,  11, 0.60, 0.75, 5.0),
    _t("Titan-RTX",   16.3,    130.5,     672.0,  24, 0.60, 0.75, 5.0),
    # a CPU worker process of local-cpu-N (emulation): a few cores of fp32 SIMD, DRAM share,
    # ATen dispatch overhead per op; gloo moves and sums bytes on the same cores
    _t("cpu",         0.05,    None,      20.0,   8,  0.50, 0.60, 20.0, host_driven_comm=True),
)

CATALOG: dict[str, DeviceType] = {t.name: t for t in _TYPES}

# Sailor's and Metis' GPU names -> catalog names, as their plan, profile and bandwidth files write them
# (eth-easl/sailor cf2c8e3: sailor/Planner/simulations/validation/**/plan_config_*.json,
# sailor/Planner/baselines/Metis/profiles/<model>/<gpu>/, sailor/providers/*.json). Sailor's "RTX-2080" is
# an 11 GiB card (GPU_MEMORY_GB in sailor/Planner/simulations/constants.py and
# sailor/Planner/simulations/configs/basic_cluster_config.json): an RTX 2080 Ti's memory, not the 8 GB RTX
# 2080's, so in their files the name means the catalog's RTX-2080Ti
SAILOR_NAMES: dict[str, str] = {
    "GH-96": "GH200-96GB",
    "H100-80": "H100",
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "V100-16": "V100-16GB",
    "V100-32": "V100-32GB",
    "T4-16": "T4",
    "RTX-2080": "RTX-2080Ti",
    "RTX-3090": "RTX-3090",
    "Titan-RTX": "Titan-RTX",
}
# names that are not catalog names and mean one catalog type wherever they are written
ALIASES: dict[str, str] = {k: v for k, v in SAILOR_NAMES.items() if k not in CATALOG}


def _unknown(name: object) -> ClusterError:
    return ClusterError(f"unknown device type {name!r}; known: {', '.join(CATALOG)}; aliases: {', '.join(ALIASES)}")


def resolve_type(name: str) -> str:
    """The catalog name of ``name``: itself if it is one, else its ``ALIASES`` entry (either compared without
    case); ClusterError naming it (and the known names) if it is neither."""
    if isinstance(name, str) and name in CATALOG:
        return name
    folded = {k.lower(): v for k, v in {**{t: t for t in CATALOG}, **ALIASES}.items()}
    if not isinstance(name, str) or name.lower() not in folded:
        raise _unknown(name)
    return folded[name.lower()]


def sailor_type(name: str) -> str:
    """The catalog name of a GPU as Sailor's and Metis' files name it (``SAILOR_NAMES``, compared without
    case; other names as ``resolve_type``)."""
    folded = {k.lower(): v for k, v in SAILOR_NAMES.items()}
    if isinstance(name, str) and name.lower() in folded:
        return folded[name.lower()]
    return resolve_type(name)


def device_type(name: str) -> DeviceType:
    """The catalog entry for ``name`` (a catalog name or an alias); ClusterError naming it (and the known
    types) if absent."""
    return CATALOG[resolve_type(name)]


# ---------------------------------------------------------------------- host CPUs
@dataclass(frozen=True)
class HostCPUType:
    """One socket of a server's host CPU, as an offloaded optimizer step and its memory traffic see it.

    ``peak_flops`` = cores x base clock x fp32 FLOP per cycle and core (vector lanes x 2 for a fused
    multiply-add x FMA pipes); ``memory_bandwidth_Bps`` = memory channels x transfers/s x 8 bytes per
    channel (DDR4/DDR5), or the vendor's figure where the memory is not channels of DIMMs (Grace's
    LPDDR5X). Both are per socket; a server multiplies them by its sockets. The efficiencies are priors
    (the fraction of peak a streaming kernel, resp. a vectorised update with square roots and divisions,
    reaches), not fitted to any measured step time.
    """

    name: str
    cores: int
    clock_Hz: float                     # base clock (the vendor's all-core guarantee)
    flops_per_cycle: int                # fp32 FLOP per cycle per core
    memory_bandwidth_Bps: float         # per socket, peak
    max_memory_bytes: int               # the most memory one socket addresses (vendor)
    source: str = field(repr=False)     # where the figures come from
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.75

    def __post_init__(self) -> None:
        for field_name, value in (("cores", self.cores), ("clock_Hz", self.clock_Hz),
                                  ("flops_per_cycle", self.flops_per_cycle),
                                  ("memory_bandwidth_Bps", self.memory_bandwidth_Bps),
                                  ("max_memory_bytes", self.max_memory_bytes)):
            if not value > 0:
                raise ClusterError(f"host CPU type {self.name!r}: {field_name} must be positive, got {value}")
        for field_name, value in (("compute_efficiency", self.compute_efficiency),
                                  ("memory_efficiency", self.memory_efficiency)):
            if not 0 < value <= 1:
                raise ClusterError(f"host CPU type {self.name!r}: {field_name} must be in (0, 1], got {value}")

    @property
    def peak_flops(self) -> float:
        """fp32 FLOP/s of one socket: cores x clock x FLOP per cycle."""
        return self.cores * self.clock_Hz * self.flops_per_cycle

    @property
    def effective_flops(self) -> float:
        """fp32 FLOP/s an optimizer step reaches on one socket (peak x compute efficiency)."""
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_memory_Bps(self) -> float:
        """Bytes/s a streaming kernel reaches on one socket (peak x memory efficiency)."""
        return self.memory_bandwidth_Bps * self.memory_efficiency


def ddr_bandwidth_Bps(channels: int, mega_transfers_per_s: float) -> float:
    """Peak DRAM bandwidth of ``channels`` 64-bit DDR channels at ``mega_transfers_per_s`` MT/s (8 bytes a
    transfer): DDR4-2666 x 6 channels -> 127.968 GB/s."""
    return channels * mega_transfers_per_s * 1e6 * 8


# FLOP per cycle per core in fp32: AVX-512 with two FMA units (Xeon Gold 6xxx / Platinum 8xxx):
# 16 lanes x 2 x 2 = 64; Zen 2/Zen 3 (two 256-bit FMA pipes): 8 x 2 x 2 = 32; Neoverse V2 (four 128-bit
# SVE2 FMA pipes): 4 x 2 x 4 = 32. The base clock is used: AVX-512 code runs below it on Skylake-SP and
# Cascade Lake (its licence frequency), which the compute efficiency absorbs.
_ARK = "ark.intel.com"
_AMD = "amd.com EPYC product page"
HOST_CPU_TYPES: tuple[HostCPUType, ...] = (
    HostCPUType("Xeon-Gold-6148", 20, 2.4e9, 64, ddr_bandwidth_Bps(6, 2666), 768 * GiB,
                f"{_ARK} (Skylake-SP, 2017): 20 cores, 2.4 GHz base, 2 AVX-512 FMA units, 6 ch DDR4-2666"),
    HostCPUType("Xeon-Platinum-8168", 24, 2.7e9, 64, ddr_bandwidth_Bps(6, 2666), 768 * GiB,
                f"{_ARK} (Skylake-SP, 2017): 24 cores, 2.7 GHz base, 2 AVX-512 FMA units, 6 ch DDR4-2666; "
                f"the NVIDIA DGX-2's CPU (DGX-2 datasheet: 2 sockets, 1.5 TB)"),
    HostCPUType("Xeon-Gold-6248", 20, 2.5e9, 64, ddr_bandwidth_Bps(6, 2933), 1024 * GiB,
                f"{_ARK} (Cascade Lake, 2019): 20 cores, 2.5 GHz base, 2 AVX-512 FMA units, 6 ch DDR4-2933"),
    HostCPUType("Xeon-Platinum-8380", 40, 2.3e9, 64, ddr_bandwidth_Bps(8, 3200), 6144 * GiB,
                f"{_ARK} (Ice Lake-SP, 2021): 40 cores, 2.3 GHz base, 2 AVX-512 FMA units, 8 ch DDR4-3200"),
    HostCPUType("Xeon-Platinum-8480+", 56, 2.0e9, 64, ddr_bandwidth_Bps(8, 4800), 4096 * GiB,
                f"{_ARK} (Sapphire Rapids, 2023): 56 cores, 2.0 GHz base, 2 AVX-512 FMA units, 8 ch DDR5-4800; "
                f"the NVIDIA DGX H100's CPU (8480C)"),
    HostCPUType("EPYC-7742", 64, 2.25e9, 32, ddr_bandwidth_Bps(8, 3200), 4096 * GiB,
                f"{_AMD} (Rome, 2019): 64 cores, 2.25 GHz base, 2x256-bit FMA (Zen 2), 8 ch DDR4-3200; "
                f"the NVIDIA DGX A100's CPU"),
    HostCPUType("EPYC-7763", 64, 2.45e9, 32, ddr_bandwidth_Bps(8, 3200), 4096 * GiB,
                f"{_AMD} (Milan, 2021): 64 cores, 2.45 GHz base, 2x256-bit FMA (Zen 3), 8 ch DDR4-3200"),
    # Grace's LPDDR5X is soldered next to the die; NVIDIA gives its bandwidth, not channels: the Grace
    # CPU Superchip datasheet's 1 TB/s for two Grace dies is 500 GB/s each (the GH200 datasheet's
    # "up to 500 GB/s"); capacity up to 480 GB per Grace
    HostCPUType("Grace", 72, 3.1e9, 32, 500e9, 480 * 10**9,
                "NVIDIA Grace CPU / GH200 Grace Hopper Superchip datasheets (2023): 72 Neoverse V2 cores, "
                "3.1 GHz base, 4x128-bit SVE2 FMA pipes, LPDDR5X up to 480 GB at up to 500 GB/s"),
)

HOST_CATALOG: dict[str, HostCPUType] = {t.name: t for t in HOST_CPU_TYPES}


def host_cpu_type(name: str) -> HostCPUType:
    """The host CPU catalog entry ``name`` (compared without case); ClusterError naming it and the known
    types if absent."""
    folded = {k.lower(): v for k, v in HOST_CATALOG.items()}
    if not isinstance(name, str) or name.lower() not in folded:
        raise ClusterError(f"unknown host CPU type {name!r}; known: {', '.join(HOST_CATALOG)}")
    return folded[name.lower()]
