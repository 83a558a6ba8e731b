"""Policy inputs as torch tensors: from the env's (padded) observation or straight from the numpy
features of ``envs.features`` (what the trainer uses, without padding)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from envs.features import GraphFeatures


@dataclass(frozen=True)
class PolicyInputs:
    """The tensors :meth:`agents.networks.StrategyPolicy.forward` takes, in its order.

    Shapes: op_x ``(N, F_op)`` float32, op_mask ``(N,)`` bool, edge_index ``(2, E)`` int64,
    edge_mask ``(E,)`` bool, group_of ``(N,)`` int64 (-1 on padding ops), group_mask ``(G,)`` bool,
    dev_x ``(D, F_dev)`` float32, dev_mask ``(D,)`` bool or None (None: every device row is real;
    only the device-token head takes padded device rows).
    """

    op_x: Tensor
    op_mask: Tensor
    edge_index: Tensor
    edge_mask: Tensor
    group_of: Tensor
    group_mask: Tensor
    dev_x: Tensor
    dev_mask: Tensor | None = None

    def args(self) -> tuple[Tensor, ...]:
        """Positional arguments for the policy's forward/distribution (``dev_mask`` only when given)."""
        return tuple(getattr(self, f.name) for f in fields(self)
                     if f.name != "dev_mask" or self.dev_mask is not None)

    @property
    def n_groups(self) -> int:
        """Real groups."""
        return int(self.group_mask.sum())

    @property
    def n_devices(self) -> int:
        """Real devices."""
        return int(self.dev_x.shape[0]) if self.dev_mask is None else int(self.dev_mask.sum())

    @classmethod
    def from_features(cls, features: GraphFeatures) -> PolicyInputs:
        """Unpadded inputs (every op, edge and group real)."""
        n, e, g = features.n_ops, features.n_edges, features.n_groups
        return cls(torch.from_numpy(np.ascontiguousarray(features.op_x, dtype=np.float32)),
                   torch.ones(n, dtype=torch.bool),
                   torch.from_numpy(np.ascontiguousarray(features.edge_index, dtype=np.int64)),
                   torch.ones(e, dtype=torch.bool),
                   torch.from_numpy(np.ascontiguousarray(features.group_of, dtype=np.int64)),
                   torch.ones(g, dtype=torch.bool),
                   torch.from_numpy(np.ascontiguousarray(features.dev_x, dtype=np.float32)))

    @classmethod
    def from_observation(cls, obs: dict, trim: bool = True) -> PolicyInputs:
        """From one env observation. ``trim`` drops the padding at the end (the env puts real entries
        first, and real devices first when it pads them), which saves the encoder work; the logits of real
        groups are the same either way."""
        op_mask = np.asarray(obs["op_mask"]).astype(bool)
        edge_mask = np.asarray(obs["edge_mask"]).astype(bool)
        group_mask = np.asarray(obs["group_mask"]).astype(bool)
        op_x, edge_index, group_of = obs["op_x"], obs["edge_index"], obs["group_of"]
        dev_x = np.asarray(obs["dev_x"], dtype=np.float32)
        dev_mask = np.asarray(obs["dev_mask"]).astype(bool) if "dev_mask" in obs else None
        if trim and dev_mask is not None:
            dev_x, dev_mask = dev_x[:int(dev_mask.sum())], None
        if trim:
            n, e, g = int(op_mask.sum()), int(edge_mask.sum()), int(group_mask.sum())
            op_x, op_mask, group_of = op_x[:n], op_mask[:n], group_of[:n]
            edge_index, edge_mask, group_mask = edge_index[:, :e], edge_mask[:e], group_mask[:g]
        return cls(torch.as_tensor(np.asarray(op_x, dtype=np.float32)), torch.as_tensor(op_mask),
                   torch.as_tensor(np.asarray(edge_index, dtype=np.int64)), torch.as_tensor(edge_mask),
                   torch.as_tensor(np.asarray(group_of, dtype=np.int64)), torch.as_tensor(group_mask),
                   torch.as_tensor(dev_x), None if dev_mask is None else torch.as_tensor(dev_mask))

    @classmethod
    def from_batched_observation(cls, obs: dict, trim: bool = True) -> list[PolicyInputs]:
        """One PolicyInputs per sub-environment of a vector env's batched observation."""
        n_envs = np.asarray(obs["op_mask"]).shape[0]
        return [cls.from_observation({k: np.asarray(v)[i] for k, v in obs.items()}, trim) for i in range(n_envs)]


def pad_actions(actions: np.ndarray, max_groups: int) -> np.ndarray:
    """Actions of the real groups ``(..., G)`` padded with 0 to the env's ``(..., max_groups)``."""
    actions = np.asarray(actions, dtype=np.int64)
    out = np.zeros(actions.shape[:-1] + (max_groups,), dtype=np.int64)
    out[..., :actions.shape[-1]] = actions
    return out


def pad_plans(plans: np.ndarray, n_groups: int, max_groups: int) -> np.ndarray:
    """Plans over the real groups ``(..., 2 G + 1)`` (``envs.actions``) as the env's actions
    ``(..., 2 max_groups + 1)``: configs and recompute bits padded with 0, the micro-batch choice last."""
    plans = np.asarray(plans, dtype=np.int64)
    g = int(n_groups)
    out = np.zeros(plans.shape[:-1] + (2 * max_groups + 1,), dtype=np.int64)
    out[..., :g] = plans[..., :g]
    out[..., max_groups:max_groups + g] = plans[..., g:2 * g]
    out[..., -1] = plans[..., -1]
    return out
