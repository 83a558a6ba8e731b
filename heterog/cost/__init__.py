"""Cost models for the compiler: op compute time per device and batch share (roofline, measured op
profile or per-layer profile), transfer time over link paths, AllReduce (ring / hierarchical) and PS aggregation;
host-side offloading costs (GPU<->host transfers, the optimizer step on the host, host memory) in ``host``."""
from heterog.cost.layer_profile import LayerProfile, LayerProfileError, source_summary
from heterog.cost.model import CollectiveCost, CostModel
from heterog.cost.profile import ProfileTable, fit_linear, op_signature

__all__ = ["CollectiveCost", "CostModel", "LayerProfile", "LayerProfileError", "ProfileTable", "fit_linear",
           "op_signature", "source_summary"]
