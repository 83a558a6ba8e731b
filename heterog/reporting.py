"""Every table the project prints or writes: one ``Table`` (columns and formatted cells) rendered as plain
text, Markdown or a rich table, and the builders of the simulate/compare, paper (Tables 1-2), main-job,
fidelity and bench tables.
"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from heterog.actions import DP_ACTION_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from rich.table import Table as RichTable

    from heterog.cluster import Cluster
    from heterog.cost import CostModel
    from heterog.evaluate import PlanResult
    from heterog.graph.opgraph import OpGraph
    from heterog.interop.published import PublishedReport
    from heterog.runtime.fidelity import FidelityReport

DP_BASELINES = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
DEFAULT_ORDER = "best"          # heterog.scheduler.DEFAULT_ORDER (not imported: numba loads lazily)

Align: TypeAlias = Literal["left", "right"]


# ----------------------------------------------------------------------------- what the tables read
# heterog.compare imports this module, so its results are described here by what the tables read of them.
class MethodOutcome(Protocol):
    """One planner's outcome (``heterog.compare.MethodResult``)."""

    @property
    def method(self) -> str: ...

    @property
    def result(self) -> PlanResult: ...

    @property
    def record(self) -> dict[str, Any]: ...


class ComparisonLike(Protocol):
    """Several planners' outcomes on one graph and cluster (``heterog.compare.Comparison``)."""

    @property
    def graph(self) -> OpGraph: ...

    @property
    def cluster(self) -> Cluster: ...

    @property
    def results(self) -> Sequence[MethodOutcome]: ...

    def records(self) -> list[dict[str, Any]]: ...

    def best(self) -> MethodOutcome: ...


# ----------------------------------------------------------------------------- one table, three renderings
@dataclass(frozen=True)
class Column:
    """A column: its header, its width in plain text (cells are padded to it) and its alignment."""

    header: str
    width: int = 0
    align: Align = "right"

    def pad(self, cell: str) -> str:
        return cell.ljust(self.width) if self.align == "left" else cell.rjust(self.width)


@dataclass
class Table:
    """Columns and rows of already formatted cells (strings)."""

    columns: list[Column]
    rows: list[list[str]] = field(default_factory=list)
    title: str | None = None

    def add(self, *cells: str) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def text(self, *, header: bool = True, rule: bool = False) -> str:
        """Plain text, cells padded to their column's width and joined by one space; ``rule``: a line of
        dashes under the header."""
        lines = []
        if header:
            head = " ".join(c.pad(c.header) for c in self.columns)
            lines += [head] + (["-" * len(head)] if rule else [])
        lines += [" ".join(c.pad(cell) for c, cell in zip(self.columns, row)) for row in self.rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        """A Markdown table (first column left-aligned as its column says, the others as theirs)."""
        rule = "|" + "|".join("---:" if c.align == "right" else "---" for c in self.columns) + "|"
        lines = ["| " + " | ".join(c.header for c in self.columns) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def rich(self) -> RichTable:
        """A ``rich.table.Table`` with this title, columns and rows."""
        from rich.table import Table as RichTable

        tab = RichTable(title=self.title)
        for c in self.columns:
            tab.add_column(c.header, justify=c.align)
        for row in self.rows:
            tab.add_row(*row)
        return tab


def key_values(values: dict) -> str:
    """``key value`` lines, keys padded to 36 characters (``heterog bench``)."""
    tab = Table([Column("key", 36, "left"), Column("value")])
    for k, v in values.items():
        tab.add(str(k), str(v))
    return tab.text(header=False)


# ----------------------------------------------------------------------------- simulate / compare records
def records_table(records: list[dict]) -> Table:
    """Iteration time, order, compute and communication time, overlap, max peak memory, OOM and search
    time of simulate/compare records."""
    tab = Table([Column("method", 12, "left"), Column("iter ms", 9), Column("order", 15), Column("compute ms", 10),
                 Column("comm ms", 9), Column("overlap", 7), Column("peak GiB (max)", 14), Column("OOM", 4),
                 Column("search s", 8)])
    for r in records:
        peak = max(r["peak_memory_bytes"].values()) / 2**30 if r["peak_memory_bytes"] else 0.0
        tab.add(r["method"], f"{r['iteration_time_s'] * 1e3:.2f}", r.get("order", ""),
                f"{r['compute_time_s'] * 1e3:.2f}", f"{r['comm_time_s'] * 1e3:.2f}", f"{r['overlap_ratio']:.2f}",
                f"{peak:.2f}", "yes" if r["oom"] else "no", f"{r.get('search_time_s', 0.0):.2f}")
    return tab


def format_table(records: list[dict]) -> str:
    """The plain-text table of simulate/compare records."""
    return records_table(records).text(rule=True)


def comparison_text(comp: ComparisonLike) -> str:
    """A ``heterog.compare.Comparison`` for the terminal: its records' table and the best plan."""
    best = comp.best()
    return (format_table(comp.records()) + f"\nbest: {best.method} "
            f"{best.result.iteration_time_s * 1e3:.2f} ms{' (OOM)' if best.result.oom else ''}")


def portfolio_table(tried: list[dict[str, Any]], chosen: str | None) -> Table:
    """What each planner of a portfolio (``heterog.replan``'s ``tried``) found: its plan's iteration time, OOM
    and the seconds it took, or why it has no plan; the chosen one marked."""
    tab = Table([Column("planner", 12, "left"), Column("iter ms", 10), Column("OOM", 4), Column("seconds", 8),
                 Column("", 1, "left")])
    for e in tried:
        has_plan = "iteration_time_s" in e
        note = "chosen" if e["method"] == chosen else str(e.get("error") or e.get("refused") or "")
        tab.add(e["method"], f"{e['iteration_time_s'] * 1e3:.2f}" if has_plan else "-",
                ("yes" if e["oom"] else "no") if has_plan else "-", f"{e['seconds']:.2f}", note)
    return tab


# ----------------------------------------------------------------------------- the paper's Tables 1 and 2
def _speedup(t_base: float, t: float) -> str:
    return f"{(t_base / t - 1.0) * 100:+.1f}%" if t > 0 else "-"


def table1_markdown(comp: ComparisonLike) -> str:
    """Time per iteration and speed-up over each DP baseline, (T_baseline / T_method - 1)."""
    base = {r.method: r.result for r in comp.results if r.method in DP_BASELINES}
    dp_cols = [m for m in DP_BASELINES if m in base]
    tab = Table([Column("method", align="left"), Column("iteration (ms)"), Column("order"), Column("OOM"),
                 Column("search (s)")] + [Column(f"speed-up vs {m.upper()}") for m in dp_cols])
    for r in comp.results:
        res = r.result
        tab.add(r.method, f"{res.iteration_time_s * 1e3:.1f}", res.order, "OOM" if res.oom else "",
                f"{res.search_time_s:.1f}",
                *[_speedup(base[m].iteration_time_s, res.iteration_time_s) + (" (OOM)" if base[m].oom else "")
                  for m in dp_cols])
    return (f"Table 1: {comp.graph.name} (batch {comp.graph.batch_size}) on {comp.cluster.name}: time per "
            f"iteration and speed-up over the data-parallel baselines (T_baseline / T_method - 1; "
            f"a baseline that runs out of memory is marked OOM).\n\n" + tab.markdown() + "\n")


def action_columns(cluster: Cluster) -> list[str]:
    """Action types of Table 2: model parallel on each device, the four DP actions, other DP splits, and
    splits beyond the batch."""
    return [f"mp:{d}" for d in range(cluster.n_devices)] + list(DP_ACTION_NAMES) + ["dp-other", "split"]


def table2_markdown(comp: ComparisonLike) -> str:
    """Share of compute ops per action type in each plan (MP per device, the four DP actions, other splits)."""
    cols = action_columns(comp.cluster)
    names = comp.cluster.device_names
    label = {f"mp:{d}": f"MP {names[d]}" for d in range(comp.cluster.n_devices)}
    label.update({"dp-even-ps": "DP-EV-PS", "dp-even-ar": "DP-EV-AR", "dp-prop-ps": "DP-CP-PS",
                  "dp-prop-ar": "DP-CP-AR", "dp-other": "DP other", "split": "split"})
    tab = Table([Column("method", align="left")] + [Column(label[c]) for c in cols])
    for r in comp.results:
        share = r.record["action_breakdown"]
        tab.add(r.method, *[f"{share[c] * 100:.1f}%" if share[c] else "" for c in cols])
    return (f"Table 2: {comp.graph.name} on {comp.cluster.name}: share of compute ops per action type.\n\n"
            + tab.markdown() + "\n")


def csv_text(comp: ComparisonLike) -> str:
    """One row per method: the record's scalar fields, max peak memory and OOM devices."""
    cols = ["method", "graph", "batch_size", "cluster", "iteration_time_s", "order", "oom", "compute_time_s",
            "comm_time_s", "overlap_ratio", "search_time_s", "n_tasks", "max_peak_memory_bytes", "oom_devices"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in comp.results:
        rec = r.record
        peak, cap = rec["peak_memory_bytes"], rec["memory_capacity_bytes"]
        row = {**rec, "max_peak_memory_bytes": max(peak.values(), default=0.0),
               "oom_devices": ";".join(d for d in peak if peak[d] > cap[d])}
        w.writerow([row[c] for c in cols])
    return buf.getvalue()


# ----------------------------------------------------------------------------- the main job (`make run`)
def cost_table(graph: OpGraph, cluster: Cluster, cost: CostModel, n_ops: int = 3) -> Table:
    """Time of the costliest ops of distinct kinds, plus one memory-bound op, on each device type."""
    import numpy as np

    times = cost.full_batch_times(graph)
    types: dict[str, int] = {}
    for d in cluster.devices:
        types.setdefault(d.type.name, d.index)
    picks: list[int] = []
    seen: set[str] = set()
    for i in np.argsort(-times.mean(axis=1), kind="stable"):
        op = graph.ops[int(i)]
        if op.kind == "compute" and op.target not in seen:
            seen.add(op.target)
            picks.append(int(i))
        if len(picks) >= n_ops:
            break
    intensity = graph.flops / np.maximum(graph.bytes_total, 1.0)
    memory_bound = [int(i) for i in np.argsort(-graph.bytes_total, kind="stable")
                    if graph.ops[int(i)].kind == "compute" and intensity[i] < 1.0]
    if memory_bound and memory_bound[0] not in picks:
        picks.append(memory_bound[0])
    tab = Table([Column("op", align="left"), Column("output", align="left"), Column("GFLOP"), Column("MB moved")]
                + [Column(t) for t in types],
                title=f"op time on the {cluster.name} device types (ms, batch {graph.batch_size})")
    for i in picks:
        op = graph.ops[i]
        tab.add(op.target, str(op.output_shapes[0] if op.output_shapes else ""), f"{op.flops / 1e9:.2f}",
                f"{graph.bytes_total[i] / 1e6:.1f}", *[f"{times[i, d] * 1e3:.3f}" for d in types.values()])
    return tab


def comparison_table(records: list[dict], title: str, dp_methods: Sequence[str] = DP_BASELINES) -> Table:
    """Iteration time, speed-up over the best DP baseline, breakdown, memory and search time per method."""
    best_dp = min((r["iteration_time_s"] for r in records
                   if r["method"] in dp_methods and r["order_requested"] == DEFAULT_ORDER and not r["oom"]),
                  default=None)
    tab = Table([Column("method", align="left"), Column("order", align="left"), Column("iter ms"),
                 Column("vs best DP"), Column("compute ms"), Column("comm ms"), Column("overlap"),
                 Column("max peak GiB"), Column("OOM"), Column("search s")], title=title)
    for r in records:
        peak = max(r["peak_memory_bytes"].values()) / 2**30
        speedup = f"{best_dp / r['iteration_time_s']:.2f}x" if best_dp else "-"
        order = f"best: {r['order']}" if r["order_requested"] == DEFAULT_ORDER else f"{r['order']} (paper)"
        tab.add(r["method"], order, f"{r['iteration_time_s'] * 1e3:.1f}", speedup,
                f"{r['compute_time_s'] * 1e3:.1f}", f"{r['comm_time_s'] * 1e3:.1f}", f"{r['overlap_ratio']:.2f}",
                f"{peak:.2f}", "OOM" if r["oom"] else "", f"{r.get('search_time_s', 0.0):.1f}")
    return tab


# ----------------------------------------------------------------------------- fidelity
def fidelity_text(rep: FidelityReport, rec: dict[str, Any]) -> str:
    """A ``heterog.runtime.fidelity`` report (``rec`` its record): summary, measured vs simulated time per
    plan and, when traced, where the time goes per device."""
    head = (f"{rep.model} (batch {rep.batch_size}) on {rep.cluster}: MAPE {rep.mape:.1f}%, Kendall tau "
            f"{rep.kendall_tau:.2f} over {len(rep.pairs)} plans (profile {rep.profile}, plot {rep.plot}); "
            f"with op lines instead of points: MAPE {rec['op_lines']['mape']:.1f}%, "
            f"tau {rec['op_lines']['kendall_tau']:.2f}")
    pairs = Table([Column("plan", 14, "left"), Column("measured ms", 12), Column("simulated ms", 13),
                   Column("error", 8)])
    for p in rep.pairs:
        pairs.add(p.plan, f"{p.measured_s * 1e3:.3f}", f"{p.simulated_s * 1e3:.3f}", f"{p.error * 100:.1f}%")
    out = [head, pairs.text()]
    if rep.breakdown:
        parts = Table([Column("plan", 14, "left"), Column("device", 24, "left")]
                      + [Column(h, 15) for h in ("compute", "fed compute", "other compute", "communication",
                                                 "wait / idle")])
        for part in rep.breakdown:
            for d in part["devices"]:
                m, s = d["measured"], d["simulated"]
                cells = [(m["compute_s"], s["compute_s"]), (m["fed_compute_s"], s["fed_compute_s"]),
                         (m["compute_s"] - m["fed_compute_s"], s["compute_s"] - s["fed_compute_s"]),
                         (m["comm_s"], s["comm_s"]), (m["wait_s"], s["idle_s"])]
                parts.add(part["plan"], d["device"], *[f"{a * 1e3:7.2f}/{b * 1e3:<7.2f}" for a, b in cells])
        out += ["", "where the time goes, measured / simulated ms per step (fed: compute ops that read a message; "
                    "wait / idle: the rank waiting, the device idle in the simulation)", parts.text()]
    return "\n".join(out)


def published_text(rep: PublishedReport) -> str:
    """A ``heterog.interop.published`` report: per run measured / simulated / Sailor's prediction of the
    iteration time and peak memory, then the per-cluster summary."""
    runs = Table([Column("run", 44, "left"), Column("GPUs", 5), Column("meas s", 9), Column("ours s", 9),
                  Column("err", 7), Column("Sailor s", 9), Column("meas GB", 8), Column("ours GB", 8),
                  Column("err", 7), Column("Sailor GB", 9), Column("note", 30, "left")])
    for r in rep.records:
        note = r.error or (f"excluded: {r.excluded}" if r.excluded else ("OOM " if r.oom else "") + r.note)
        runs.add(r.name, str(r.n_gpus), f"{r.measured_s:.3f}", f"{r.simulated_s:.3f}", f"{100 * r.time_error:+.1f}%",
                 f"{r.sailor_s:.3f}", f"{r.measured_peak_bytes / 1e9:.2f}",
                 f"{(r.simulated_peak_bytes if math.isnan(r.in_use_peak_bytes) else r.in_use_peak_bytes) / 1e9:.2f}",
                 f"{100 * r.memory_error:+.1f}%", f"{r.sailor_peak_bytes / 1e9:.2f}", note[:120])
    summary = Table([Column("cluster", 9, "left"), Column("runs", 5), Column("time MAPE", 10),
                     Column("tau", 6), Column("mem MAPE", 9), Column("mem max", 8), Column("tensors", 8),
                     Column("Sailor time", 12), Column("Sailor tau", 11), Column("Sailor mem", 11)])
    for kind, s in rep.summary.items():
        summary.add(kind, str(int(s["runs"])), f"{s['time_mape_pct']:.1f}%", f"{s['kendall_tau']:.2f}",
                    f"{s['memory_mape_pct']:.1f}%", f"{s['memory_max_error_pct']:.1f}%",
                    f"{s['tensor_memory_mape_pct']:.1f}%", f"{s['sailor_time_mape_pct']:.1f}%",
                    f"{s['sailor_kendall_tau']:.2f}", f"{s['sailor_memory_mape_pct']:.1f}%")
    oh = rep.memory_overhead
    memory = ("memory in use = tensors' peak" if oh is None else
              f"memory in use = (1 + {oh.reserve:.3f}) x tensors' peak + {oh.fixed_bytes / 1e9:.2f} GB ({oh.source})")
    return f"cost source: {rep.source}\n{runs.text()}\n\n{summary.text()}\n{memory}; 'tensors': MAPE of the peak alone"


__all__ = ["Column", "ComparisonLike", "MethodOutcome", "Table", "action_columns", "comparison_table",
           "comparison_text", "cost_table", "csv_text", "fidelity_text", "format_table", "key_values",
           "published_text", "records_table", "table1_markdown", "table2_markdown"]
