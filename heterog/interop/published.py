"""Sailor's published runs against the simulator: each validation plan (``plan_config_*.json`` under
``clariden/`` and ``mit/`` of sailor/Planner/simulations/validation) imported onto the model and cluster it
ran on, simulated with the roofline catalog or with Metis' layer profiles, and compared with its measured
iteration time (``"real"``) and peak memory (``"max_mem"``); Sailor's own simulator's predictions of the
same plans side by side. ``heterog fidelity --published DIR`` prints the report.

Memory: the measured figure is memory in use; the simulator tracks tensors. What lies beyond them (a fixed
amount per process and the allocator's reserve, ``MemoryOverhead``) is fitted on the clariden/ runs only and
applied to every run; the mit/ runs are the held-out check and nothing is fitted on them.

Runs whose published figures look inconsistent are listed with the reason and kept out of the means
(``inconsistencies``): two different plans with identical measured time and memory, a plan whose layers
are not the model's. A layer list with one evident typo (a layer written for another, the stages
otherwise contiguous) is repaired and the repair noted (``repair_layer_lists``).
"""
from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.atomic import atomic_write_bytes
from heterog.errors import HeterogError
from heterog.interop.common import ForeignPlan

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cost.layer_profile import LayerProfile
    from heterog.graph.opgraph import OpGraph

# Sailor's model directory -> (our zoo model of what Sailor trained, Metis' profile directory name)
MODELS = {"OPT-350": ("opt_350m_megatron", "OPT-350"), "GPT-NEO": ("gpt_neo_2_7b_megatron", "GPT-Neo-2.7")}
GPUS_PER_NODE = {"clariden": 4, "mit": 8}
# the MIT cluster's node options (heterog.cluster.published.mit) by Sailor's GPU name
MIT_NODES = {"RTX-3090": "rtx3090", "Titan-RTX": "titan-rtx", "RTX-2080": "rtx2080"}
OPTIMIZER = "adam"          # Sailor's runs train with DeepSpeed's AdamW (ae_scripts/clariden_scripts/run_opt.slurm)
# DeepSpeed (no ZeRO, as those runs configure it) all-reduces gradients in buffers of MEMORY_OPT_ALLREDUCE_SIZE
# = 5e8 elements (deepspeed/runtime/engine.py and pipe/engine.py: allreduce_gradients), fp32 gradients here
DEEPSPEED_ALLREDUCE_BUCKET_BYTES = 500_000_000 * 4
# and its PipelineEngine runs its send, receive and reduce instructions in line with its compute (the cost
# model's ``comm_blocks_compute``)
DEEPSPEED_BLOCKING_COMM = True
DUPLICATE_RTOL = 1e-9


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: its plan and what was measured (seconds per iteration, peak bytes of the fullest
    GPU)."""

    name: str                   # path under the validation folder, e.g. "clariden/OPT-350/N4/plan_config_N4_D2.json"
    cluster_kind: str           # "clariden" | "mit"
    model: str                  # our zoo model of what ran
    profile_model: str          # its name in Metis' profile folders
    plan: ForeignPlan
    measured_s: float
    measured_peak_bytes: float
    note: str = ""              # what was repaired in the file (``repair_layer_lists``)

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def gpus(self) -> dict[str, int]:
        """GPUs of each (Sailor-named) type the plan uses."""
        out: dict[str, int] = {}
        for pipe in self.plan.pipelines:
            for st in pipe:
                for replica in st.replicas:
                    for g in replica:
                        out[g] = out.get(g, 0) + 1
        return out

    def cluster_spec(self) -> str:
        """The built-in cluster of the nodes the plan runs on (whole nodes of the cluster's size)."""
        per_node = GPUS_PER_NODE[self.cluster_kind]
        nodes = {g: math.ceil(n / per_node) for g, n in self.gpus().items()}
        if self.cluster_kind == "clariden":
            return f"clariden:nodes={sum(nodes.values())}"
        unknown = sorted(set(nodes) - set(MIT_NODES))
        if unknown:
            raise HeterogError(f"{self.name}: GPU types {unknown} are not in the MIT cluster ({sorted(MIT_NODES)})")
        return "mit:" + ",".join(f"{MIT_NODES[g]}={nodes.get(g, 0)}" for g in MIT_NODES)


def _kind_and_model(path: Path) -> tuple[str, str, str]:
    """(cluster kind, zoo model, the run's name: its path from the cluster's folder on)."""
    parts = path.resolve().parts
    at = max((i for i, p in enumerate(parts) if p in GPUS_PER_NODE), default=None)
    if at is None:
        raise HeterogError(f"{path}: not under a clariden/ or mit/ folder")
    model = next((MODELS[p][0] for p in parts[at:] if p in MODELS), MODELS["OPT-350"][0])   # mit/ ran OPT-350
    return parts[at], model, "/".join(parts[at:])


def repair_layer_lists(d: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A plan file whose stages list one layer twice and miss another, where putting the missing layer in
    place of the copy that breaks a stage's run makes every stage contiguous again (Sailor's four-stage
    GPT-Neo plans list ``[16, 17, 18, 29, 20, ...]``): that plan, repaired, and a note saying what was
    changed; any other file unchanged, with no note."""
    import copy

    out, notes = copy.deepcopy(d), []
    for p, pipe in enumerate(out.get("pipeline_list", [])):
        stages = pipe.get("layers_per_stage", [])
        flat = [x for st in stages for x in st]
        missing = sorted(set(range(len(flat))) - set(flat))
        twice = sorted({x for x in flat if flat.count(x) > 1})
        if len(missing) != 1 or len(twice) != 1:
            continue
        for s_i, st in enumerate(stages):
            for i, x in enumerate(st):
                trial = [*st[:i], missing[0], *st[i + 1:]]
                if x == twice[0] and trial == list(range(trial[0], trial[0] + len(trial))):
                    st[i] = missing[0]
                    notes.append(f"pipeline {p} stage {s_i} lists layer {x} for {missing[0]} (repaired)")
                    break
    return out, "; ".join(notes)


def find_runs(directory: str | Path) -> list[PublishedRun]:
    """Every ``plan_config_*.json`` under ``directory`` (Sailor's validation folder, or one of its
    clariden/ mit/ folders, or a copy), in path order."""
    from heterog.atomic import read_json_file
    from heterog.interop.sailor import read_sailor

    root = Path(directory)
    if not root.is_dir():
        raise HeterogError(f"published runs folder {str(root)!r} does not exist")
    runs = []
    for path in sorted(root.rglob("plan_config_*.json")):
        kind, model, name = _kind_and_model(path)
        d, note = repair_layer_lists(read_json_file(path, "plan file", HeterogError))
        plan = read_sailor(d, source=str(path))
        profile_model = next(m[1] for m in MODELS.values() if m[0] == model)
        runs.append(PublishedRun(name, kind, model, profile_model, plan, float(d["real"]), float(d["max_mem"]), note))
    if not runs:
        raise HeterogError(f"no plan_config_*.json under {str(root)!r}")
    return runs


def _layout(plan: ForeignPlan) -> tuple[Any, ...]:
    return plan.pipelines, plan.global_batch, plan.micro_batches


def inconsistencies(runs: Sequence[PublishedRun], n_layers: Callable[[str], int]) -> dict[str, str]:
    """Runs whose published figures look wrong, with the reason: two different plans with identical
    measured time and peak memory (each names the other), a plan whose layers are not its model's
    (``n_layers(model)``: layers in Metis' numbering)."""
    out: dict[str, str] = {}
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            same = (math.isclose(a.measured_s, b.measured_s, rel_tol=DUPLICATE_RTOL)
                    and math.isclose(a.measured_peak_bytes, b.measured_peak_bytes, rel_tol=DUPLICATE_RTOL))
            if same and _layout(a.plan) != _layout(b.plan):
                for x, y in ((a, b), (b, a)):
                    out.setdefault(x.name, f"same measured time ({x.measured_s} s) and peak memory "
                                           f"({x.measured_peak_bytes:.0f} B) as the different plan {y.name}")
    for r in runs:
        held = sum(len(st.layers) for st in r.plan.pipelines[0])
        want = n_layers(r.model)
        if held != want:
            out.setdefault(r.name, f"the plan holds {held} layers, {r.model} has {want} (Metis' numbering)")
    return out


@dataclass(frozen=True)
class MemoryOverhead:
    """What a GPU's memory in use holds beyond the tensors the simulator tracks (the measured figure is NVML's
    memory in use, DeepSpeed's ``get_total_used_mem``): ``fixed_bytes`` per process (the CUDA context, NCCL's
    buffers, library workspaces) and the caching allocator's reserve, a ``reserve`` fraction of the tensors'
    peak. Fitted on runs of one cluster (``fit_memory_overhead``), named by ``source``."""

    fixed_bytes: float
    reserve: float
    source: str

    def in_use(self, tensor_peak_bytes: float) -> float:
        """The memory in use a tensor peak stands for."""
        return (1.0 + self.reserve) * tensor_peak_bytes + self.fixed_bytes


CALIBRATION_CLUSTER = "clariden"       # what may be fitted on: the mit/ runs are the held-out check


def fit_memory_overhead(records: Sequence[RunRecord], cluster: str = CALIBRATION_CLUSTER) -> MemoryOverhead | None:
    """The ``MemoryOverhead`` that brings the counted, simulated runs of ``cluster`` closest to their measured
    peaks (least squares of the log ratio; both terms >= 0); None without such runs."""
    rs = [r for r in records if r.cluster == cluster and not r.excluded and not r.error
          and math.isfinite(r.simulated_peak_bytes) and r.simulated_peak_bytes > 0]
    if not rs:
        return None
    from scipy.optimize import least_squares

    sim = np.array([r.simulated_peak_bytes for r in rs])
    meas = np.array([r.measured_peak_bytes for r in rs])
    scale = 1e9                               # fit in GB

    def residual(x: np.ndarray) -> np.ndarray:
        return np.log(((1.0 + x[1]) * sim + x[0] * scale) / meas)

    fit = least_squares(residual, np.array([1.0, 0.05]), bounds=([0.0, 0.0], [np.inf, np.inf]))
    return MemoryOverhead(float(fit.x[0] * scale), float(fit.x[1]),
                          f"fitted on the {len(rs)} counted {cluster}/ runs of this report")


@dataclass
class RunRecord:
    """One run: measured, simulated by us, predicted by Sailor's simulator (NaN where absent)."""

    name: str
    cluster: str
    model: str
    global_batch: int
    n_gpus: int
    measured_s: float
    measured_peak_bytes: float
    simulated_s: float = math.nan
    simulated_peak_bytes: float = math.nan      # the simulator's peak of the fullest GPU (its tensors)
    in_use_peak_bytes: float = math.nan         # that peak as memory in use (``MemoryOverhead``), where fitted
    oom: bool = False
    sailor_s: float = math.nan
    sailor_peak_bytes: float = math.nan
    excluded: str = ""          # why the run stays out of the means ("" = counted)
    note: str = ""              # what was repaired in the published file
    error: str = ""             # why it could not be simulated
    wall_s: float = 0.0

    @property
    def time_error(self) -> float:
        return self.simulated_s / self.measured_s - 1.0

    @property
    def memory_error(self) -> float:
        """Of the memory in use where a ``MemoryOverhead`` is fitted, else of the tensors' peak."""
        peak = self.simulated_peak_bytes if math.isnan(self.in_use_peak_bytes) else self.in_use_peak_bytes
        return peak / self.measured_peak_bytes - 1.0

    @property
    def tensor_memory_error(self) -> float:
        return self.simulated_peak_bytes / self.measured_peak_bytes - 1.0


def _mape(errors: Sequence[float]) -> float:
    e = [abs(x) for x in errors if not math.isnan(x)]
    return float(100.0 * np.mean(e)) if e else math.nan


def _tau(a: Sequence[float], b: Sequence[float]) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 2:
        return math.nan
    from scipy.stats import kendalltau

    return float(kendalltau([p[0] for p in pairs], [p[1] for p in pairs]).statistic)


def cluster_summary(records: Sequence[RunRecord]) -> dict[str, dict[str, float]]:
    """Per cluster, over the counted runs that were simulated: count, time and memory MAPE (%), the largest
    memory error (%), Kendall tau of the time order; the same for Sailor's simulator on those runs."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({r.cluster for r in records}):
        rs = [r for r in records if r.cluster == kind and not r.excluded and not r.error]
        sailor = [r for r in rs if not math.isnan(r.sailor_s)]
        out[kind] = {
            "runs": len(rs),
            "time_mape_pct": _mape([r.time_error for r in rs]),
            "memory_mape_pct": _mape([r.memory_error for r in rs]),
            "memory_max_error_pct": max((100 * abs(r.memory_error) for r in rs), default=math.nan),
            "tensor_memory_mape_pct": _mape([r.tensor_memory_error for r in rs]),
            "kendall_tau": _tau([r.measured_s for r in rs], [r.simulated_s for r in rs]),
            "sailor_runs": len(sailor),
            "sailor_time_mape_pct": _mape([r.sailor_s / r.measured_s - 1 for r in sailor]),
            "sailor_memory_mape_pct": _mape([r.sailor_peak_bytes / r.measured_peak_bytes - 1 for r in sailor]),
            "sailor_kendall_tau": _tau([r.measured_s for r in sailor], [r.sailor_s for r in sailor]),
        }
    return out


@dataclass
class PublishedReport:
    """Every run's record, the per-cluster summary, and which cost source the simulation used."""

    source: str                                   # "roofline" | "profiles:<dir>"
    records: list[RunRecord]
    summary: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_overhead: MemoryOverhead | None = None

    def record(self) -> dict[str, Any]:
        return {"cost_source": self.source, "summary": self.summary, "runs": [asdict(r) for r in self.records],
                "memory_overhead": None if self.memory_overhead is None else asdict(self.memory_overhead)}


def load_sailor_predictions(path: str | Path) -> dict[str, tuple[float, float]]:
    """Sailor's simulator's (time s, peak bytes) per run, keyed by the path under the validation folder,
    from ``experiments/peers.py simulate``'s JSON."""
    from heterog.atomic import read_json_file

    d = read_json_file(path, "Sailor's predictions file", HeterogError)
    out = {}
    for p in d["plans"]:
        key = p["file"].split("validation/", 1)[-1]
        out[key] = (float(p["predicted_s"]), float(p["predicted_peak_bytes"]))
    return out


def simulate_run(run: PublishedRun, graph: OpGraph, layer_profile: LayerProfile | None = None
                 ) -> tuple[float, float, bool]:
    """(simulated seconds per iteration, peak bytes of the fullest GPU, out of memory) of ``run``'s plan on
    ``graph`` (the model at the run's global batch) and the cluster it ran on."""
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator, cost_model
    from heterog.interop.common import to_strategy

    cluster = load_cluster(run.cluster_spec())
    strategy = to_strategy(run.plan, graph, cluster)
    cost = cost_model(cluster, layer_profile, allreduce_bucket_bytes=DEEPSPEED_ALLREDUCE_BUCKET_BYTES,
                      comm_blocks_compute=DEEPSPEED_BLOCKING_COMM)
    res = Evaluator(graph, cluster, cost).evaluate(strategy, method="sailor")
    return res.iteration_time_s, float(max(res.peak_memory_bytes.values())), bool(res.oom)


def published_report(directory: str | Path, *, layer_profiles: str | Path | None = None,
                     sailor_predictions: str | Path | None = None, only: Sequence[str] = (),
                     graph_of: Callable[[str, int], OpGraph] | None = None,
                     progress: Callable[[RunRecord], None] | None = None) -> PublishedReport:
    """Simulate every run under ``directory`` (those whose name contains one of ``only``, if given) and
    compare. ``layer_profiles``: Metis' profiles folder (sailor/Planner/baselines/Metis/profiles) as the
    cost source where it has entries, else the roofline. ``graph_of(model, batch)``: the captured graph
    (default: captured with Adam and cached, ``heterog.graph.cache.capture_model``)."""
    from heterog.cost.layer_profile import LayerProfile

    runs = [r for r in find_runs(directory) if not only or any(o in r.name for o in only)]
    if graph_of is None:
        from heterog.graph.cache import capture_model

        def graph_of(model: str, batch: int) -> OpGraph:
            return capture_model(model, batch, OPTIMIZER)

    from heterog.baselines.expert import block_layers

    graphs: dict[tuple[str, int], OpGraph] = {}

    def graph(model: str, batch: int) -> OpGraph:
        assert graph_of is not None
        if (model, batch) not in graphs:
            graphs[model, batch] = graph_of(model, batch)
        return graphs[model, batch]

    layers: dict[str, int] = {}

    def n_layers(model: str) -> int:             # from the model's graph at a batch one of its runs needs
        if model not in layers:
            batch = min(r.global_batch for r in runs if r.model == model)
            layers[model] = block_layers(graph(model, batch))[1] + 2
        return layers[model]

    bad = inconsistencies(runs, n_layers)
    predictions = load_sailor_predictions(sailor_predictions) if sailor_predictions else {}
    profiles: dict[str, LayerProfile] = {}
    records = []
    for run in runs:
        rec = RunRecord(run.name, run.cluster_kind, run.model, run.global_batch, sum(run.gpus().values()),
                        run.measured_s, run.measured_peak_bytes, excluded=bad.get(run.name, ""), note=run.note)
        rec.sailor_s, rec.sailor_peak_bytes = predictions.get(run.name, (math.nan, math.nan))
        t0 = time.perf_counter()
        try:
            lp = None
            if layer_profiles is not None:
                if run.profile_model not in profiles:
                    profiles[run.profile_model] = LayerProfile.load(layer_profiles,
                                                                    model=run.profile_model)
                lp = profiles[run.profile_model]
            rec.simulated_s, rec.simulated_peak_bytes, rec.oom = simulate_run(
                run, graph(run.model, run.global_batch), lp)
        except HeterogError as exc:
            rec.error = str(exc).splitlines()[0]
        rec.wall_s = time.perf_counter() - t0
        records.append(rec)
        if progress is not None:
            progress(rec)
    source = "roofline" if layer_profiles is None else f"profiles:{layer_profiles}"
    overhead = fit_memory_overhead(records)
    if overhead is not None:
        for rec in records:
            rec.in_use_peak_bytes = overhead.in_use(rec.simulated_peak_bytes)
    return PublishedReport(source, records, cluster_summary(records), overhead)


def scatter_plot(reports: Sequence[PublishedReport], path: str | Path) -> Path:
    """Predicted against measured iteration time and peak memory, one marker per cost source and for
    Sailor's simulator, log scales, the diagonal drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    markers = {"clariden": "o", "mit": "s"}
    for ax, what, unit in ((axes[0], "s", "iteration time (s)"), (axes[1], "peak_bytes", "peak memory (GB)")):
        scale = 1.0 if what == "s" else 1e-9
        lo, hi = math.inf, 0.0
        series: list[tuple[str, list[RunRecord], str]] = [(r.source.split(":")[0], r.records, "simulated_")
                                                          for r in reports]
        if reports:
            series.append(("Sailor's simulator", reports[0].records, "sailor_"))
        for label, records, prefix in series:
            for kind, marker in markers.items():
                pts = [(getattr(r, f"measured_{what}") * scale, getattr(r, prefix + what) * scale)
                       for r in records if r.cluster == kind and not r.excluded
                       and not math.isnan(getattr(r, prefix + what))]
                if pts:
                    x, y = zip(*pts)
                    ax.scatter(x, y, marker=marker, label=f"{label}, {kind}", alpha=0.7)
                    lo, hi = min(lo, *x, *y), max(hi, *x, *y)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.legend(fontsize=7)
    fig.suptitle("Sailor's published runs: predicted against measured")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
