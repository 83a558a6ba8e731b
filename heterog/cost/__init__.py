"""Cost models for the compiler: op compute time per device and batch share (roofline or measured
profile), transfer time over link paths, AllReduce (ring / hierarchical) and PS aggregation."""
from heterog.cost.model import CollectiveCost, CostModel
from heterog.cost.profile import ProfileTable, fit_linear, op_signature

__all__ = ["CollectiveCost", "CostModel", "ProfileTable", "fit_linear", "op_signature"]
