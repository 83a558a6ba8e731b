"""Errors raised for bad input. The CLI turns every HeterogError into a one-line message
and a non-zero exit; anything else is a bug and keeps its traceback."""


class HeterogError(Exception):
    """Bad input named in the message (a file, a device type, a strategy, ...)."""


class GraphError(HeterogError):
    """The training graph is malformed (cycle, dangling edge, truncated file, ...)."""


class ClusterError(HeterogError):
    """The cluster description is invalid (unknown device type, bad bandwidth, disconnected, ...)."""


class StrategyError(HeterogError):
    """A strategy does not fit its graph or cluster (fingerprint, action range, shares, ...)."""


class ModelError(HeterogError):
    """A user's model does not follow the model contract (scalar mean loss, batch on dim 0)."""


class DataDependentControlFlowError(ModelError):
    """The model's Python control flow depends on tensor values (``if x.sum() > 0:``), which a captured
    step cannot follow; the message names the model's line and the fix (torch.where / torch.cond)."""


class CheckpointError(HeterogError):
    """A checkpoint does not fit the current run (action space, graph, format)."""
