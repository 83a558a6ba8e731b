"""Event-driven simulator of one training iteration as a task graph on exclusive resources (GPUs, links).

Pure numpy + numba (imports no torch and nothing from heterog); see docs/design.md section 6 for the contract.
"""
from simulator.bench import bench, random_taskgraph
from simulator.engine import SimResult, simulate
from simulator.taskgraph import TaskGraph
from simulator.trace import chrome_trace_events, plot_gantt, write_chrome_trace

__all__ = ["SimResult", "TaskGraph", "bench", "chrome_trace_events", "plot_gantt", "random_taskgraph",
           "simulate", "write_chrome_trace"]
