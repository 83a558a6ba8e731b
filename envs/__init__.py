"""Gymnasium environments of HeteroG: one episode = one parallelisation plan of a training graph on a
cluster. Registered ids:

An action is a plan (``envs.actions``): each group's config and recompute bit, and the number of
micro-batches.

- ``HeteroG/Placement-v0``: one graph (default ``tiny_transformer`` on ``paper-8gpu``); pass
  ``graph=``, ``cluster=``, ``max_groups=``, ``oom_factor=`` ... to ``gymnasium.make``
  (``max_devices=16``: padded device tokens and device-free op features, for the device-token head).
- ``HeteroG/PlacementZoo-v0``: the tiny zoo graphs (``tiny_mlp``, ``tiny_cnn``, ``tiny_transformer``)
  in one padded space; each ``reset`` draws one of them from the env's seeded generator.
"""
import gymnasium as gym

from envs.actions import MICRO_CHOICES, PlanAction, full_plan, plan_length, plan_nvec, plan_strategy, split_plan
from envs.features import (
    DEVICE_FEATURE_DIM,
    GraphFeatures,
    device_features,
    graph_features,
    observation_space,
    op_feature_dim,
    op_features,
    pad_observation,
)
from envs.placement import PlacementEnv, resolve_cluster, resolve_graph

__all__ = ["DEVICE_FEATURE_DIM", "MICRO_CHOICES", "GraphFeatures", "PlacementEnv", "PlanAction", "device_features",
           "full_plan", "graph_features", "observation_space", "op_feature_dim", "op_features", "pad_observation",
           "plan_length", "plan_nvec", "plan_strategy", "resolve_cluster", "resolve_graph", "split_plan"]

ENV_IDS = ("HeteroG/Placement-v0", "HeteroG/PlacementZoo-v0")
TINY_ZOO = ("tiny_mlp", "tiny_cnn", "tiny_transformer")

if ENV_IDS[0] not in gym.registry:
    gym.register(id=ENV_IDS[0], entry_point="envs.placement:PlacementEnv")
if ENV_IDS[1] not in gym.registry:
    gym.register(id=ENV_IDS[1], entry_point="envs.placement:PlacementEnv", kwargs={"graph": list(TINY_ZOO)})
