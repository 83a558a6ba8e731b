"""HeteroG-style planning of DNN training on heterogeneous GPU clusters."""
