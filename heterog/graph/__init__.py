"""Training graphs: capture from torch, fusion of zero-cost ops, file I/O."""
from heterog.graph.opgraph import Edge, Op, OpGraph, load_graph

__all__ = ["Edge", "Op", "OpGraph", "load_graph"]
