"""The policy's encoders: the GAT encoder of the op graph (with the cluster folded in), the pooling of op
embeddings into group embeddings, and the device-token encoder that the device-token head points at."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv, GATv2Conv, MessagePassing
from torch_geometric.utils import scatter, to_undirected

from agents.networks.common import Modules, head_count_problems, raise_problems

GAT_CONVS = {"gat": GATConv, "gatv2": GATv2Conv}
GROUP_ACTIVATIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over the rows of ``x`` where ``mask`` is True (all rows when None). Shapes: ``(D, H)`` -> ``(H,)``."""
    if mask is None:
        return x.mean(dim=0)
    weights = mask.to(x.dtype)[:, None]
    return (x * weights).sum(dim=0) / weights.sum().clamp(min=1.0)


# ------------------------------------------------------------------------------------------ op graph
class GATEncoder(nn.Module):
    """Graph-attention encoder of the op graph with the cluster folded in.

    ``x = LayerNorm(W_in op_x + mean_m MLP(dev_x_m))``: the device set is summarised by
    mean-pooling a per-device MLP embedding (order-free over devices) and that vector is added to
    every op embedding, so the op embeddings are conditioned on the cluster. Then each layer is
    ``x = LayerNorm(x + Dropout(ELU(GAT(x))))`` with multi-head attention whose heads are
    concatenated (``hidden / heads`` channels each). Edges are used in both directions (reversed
    edges added, duplicates merged) plus self-loops; padding edges (``edge_mask`` False) are
    dropped first, so padding ops only ever see themselves and never reach a real op.

    Args:
        op_feature_dim: per-op feature size ``F_op``.
        device_feature_dim: per-device feature size ``F_dev``.
        hidden: embedding size, divisible by ``heads``.
        layers: number of GAT layers (the paper uses 12).
        heads: attention heads per layer (the paper uses 8).
        dropout: dropout on attention coefficients and on each layer's output.
        conv: ``"gat"`` (GATConv, as in the paper) or ``"gatv2"`` (GATv2Conv, dynamic attention).

    Shapes:
        op_x ``(N, F_op)``, op_mask ``(N,)``, edge_index ``(2, E)``, edge_mask ``(E,)``,
        dev_x ``(D, F_dev)``, dev_mask ``(D,)`` or None (padding device rows are left out of the mean)
        -> op embeddings ``(N, hidden)`` (padding rows are meaningless).
    """

    def __init__(self, op_feature_dim: int, device_feature_dim: int, hidden: int, layers: int, heads: int,
                 dropout: float = 0.0, conv: str = "gat") -> None:
        super().__init__()
        raise_problems(self.problems(hidden, layers, heads, conv))
        self.op_feature_dim, self.device_feature_dim = op_feature_dim, device_feature_dim
        self.hidden, self.layers, self.heads, self.dropout, self.conv = hidden, layers, heads, dropout, conv
        self.op_proj = nn.Linear(op_feature_dim, hidden)
        self.dev_mlp = nn.Sequential(nn.Linear(device_feature_dim, hidden), nn.ELU(),
                                     nn.Linear(hidden, hidden))
        self.in_norm = nn.LayerNorm(hidden)
        conv_cls = GAT_CONVS[conv]
        self.convs: Modules[MessagePassing] = Modules(
            conv_cls(hidden, hidden // heads, heads=heads, concat=True, dropout=dropout, add_self_loops=True)
            for _ in range(layers))
        self.norms: Modules[nn.LayerNorm] = Modules(nn.LayerNorm(hidden) for _ in range(layers))

    @staticmethod
    def problems(hidden: int, layers: int, heads: int, conv: str) -> list[str]:
        """What is wrong with these settings (empty when they fit)."""
        problems = [] if conv in GAT_CONVS else [f"unknown GAT conv {conv!r} (choose one of {sorted(GAT_CONVS)})"]
        if layers < 1:
            problems.append(f"GAT layers must be at least 1, got {layers}")
        return problems + head_count_problems("GAT", hidden, heads)

    def reset_parameters(self) -> None:
        self.op_proj.reset_parameters()
        for module in self.dev_mlp:
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        self.in_norm.reset_parameters()
        for conv, norm in zip(self.convs, self.norms):
            conv.reset_parameters()
            norm.reset_parameters()

    @staticmethod
    def message_edges(edge_index: Tensor, edge_mask: Tensor, num_ops: int) -> Tensor:
        """Real edges in both directions, duplicates merged (sorted by (source, target)).

        Shapes:
            edge_index ``(2, E)``, edge_mask ``(E,)`` -> ``(2, E')`` with ``E' <= 2 * E``.
        """
        return to_undirected(edge_index[:, edge_mask], num_nodes=num_ops)

    def forward(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        device_context = masked_mean(self.dev_mlp(dev_x), dev_mask)
        x = self.in_norm(self.op_proj(op_x) + device_context)
        edges = self.message_edges(edge_index, edge_mask, op_x.shape[0])
        for conv, norm in zip(self.convs, self.norms):
            update = F.dropout(F.elu(conv(x, edges)), p=self.dropout, training=self.training)
            x = norm(x + update)
        return x

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.op_feature_dim}+{self.device_feature_dim}->{self.hidden}, "
                f"layers={self.layers}, heads={self.heads}, conv={self.conv}, dropout={self.dropout})")


class GroupPooling(nn.Module):
    """Group embeddings ``g_n = sigma(sum_{o in group n} W e_o)`` (HeteroG, Sec. 4).

    The sum runs over the group's real ops only (a scatter-add). ``sigma`` is the sigmoid as in the
    paper, or tanh (zero-centred, saturates the same way). ``W`` has no bias, so an empty group
    gets ``sigma(0)``. Padding groups get all-zero embeddings.

    Args:
        hidden: embedding size (in and out).
        activation: ``"sigmoid"`` (paper) or ``"tanh"``.

    Shapes:
        op_emb ``(N, hidden)``, op_mask ``(N,)``, group_of ``(N,)``, group_mask ``(G,)``
        -> ``(G, hidden)``.
    """

    def __init__(self, hidden: int, activation: str = "sigmoid") -> None:
        super().__init__()
        raise_problems(self.problems(activation))
        self.hidden, self.activation = hidden, activation
        self.weight = nn.Linear(hidden, hidden, bias=False)

    @staticmethod
    def problems(activation: str) -> list[str]:
        """What is wrong with these settings (empty when they fit)."""
        if activation in GROUP_ACTIVATIONS:
            return []
        return [f"unknown group activation {activation!r} (choose one of {sorted(GROUP_ACTIVATIONS)})"]

    def reset_parameters(self) -> None:
        self.weight.reset_parameters()

    def forward(self, op_emb: Tensor, op_mask: Tensor, group_of: Tensor, group_mask: Tensor) -> Tensor:
        real_ops = op_mask.nonzero().squeeze(1)
        summed = scatter(self.weight(op_emb[real_ops]), group_of[real_ops], dim=0,
                         dim_size=group_mask.shape[0], reduce="sum")
        return GROUP_ACTIVATIONS[self.activation](summed) * group_mask.unsqueeze(1).to(summed.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hidden}, activation={self.activation})"


# ------------------------------------------------------------------------------------- device tokens
@dataclass(frozen=True)
class DeviceTokens:
    """The cluster as the device-token head sees it.

    Shapes: tokens ``(D, hidden)``, mask ``(D,)`` bool (True: a real device), pooled ``(hidden,)``
    (the mean of the real tokens: the cluster embedding).
    """

    tokens: Tensor
    mask: Tensor
    pooled: Tensor

    @property
    def n_devices(self) -> int:
        """Real devices ``M``."""
        return int(self.mask.sum())


class DeviceTokenEncoder(nn.Module):
    """One token per device: ``t = MLP(dev_x)`` (compute and memory of its type, its links' bandwidth
    and latency, its server share), then ``layers`` pre-LayerNorm self-attention blocks among the real
    devices (padding tokens are never attended to), so each token also knows the rest of the cluster.
    There is no position: permuting the devices permutes the tokens.

    Args:
        device_feature_dim: per-device feature size ``F_dev``.
        hidden: token size, divisible by ``heads``.
        heads: attention heads of the token mixing.
        layers: self-attention blocks (0: the MLP alone).

    Shapes:
        dev_x ``(D, F_dev)``, dev_mask ``(D,)`` bool or None (None: all real) -> :class:`DeviceTokens`
        with tokens ``(D, hidden)`` (padding rows zero) and pooled ``(hidden,)``.
    """

    def __init__(self, device_feature_dim: int, hidden: int, heads: int, layers: int = 1) -> None:
        super().__init__()
        raise_problems(self.problems(device_feature_dim, hidden, heads, layers))
        self.device_feature_dim, self.hidden, self.heads, self.layers = device_feature_dim, hidden, heads, layers
        self.embed = nn.Sequential(nn.Linear(device_feature_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden))
        self.norms: Modules[nn.LayerNorm] = Modules(nn.LayerNorm(hidden) for _ in range(layers))
        self.attns: Modules[nn.MultiheadAttention] = Modules(nn.MultiheadAttention(hidden, heads, batch_first=True)
                                                             for _ in range(layers))
        self.out_norm = nn.LayerNorm(hidden)

    @staticmethod
    def problems(device_feature_dim: int, hidden: int, heads: int, layers: int) -> list[str]:
        """What is wrong with these settings (empty when they fit)."""
        problems = []
        if device_feature_dim < 1:
            problems.append(f"device_feature_dim must be at least 1, got {device_feature_dim}")
        if layers < 0:
            problems.append(f"device token layers must be at least 0, got {layers}")
        return problems + head_count_problems("device token", hidden, heads)

    def reset_parameters(self) -> None:
        for module in self.embed:
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        for norm, attn in zip(self.norms, self.attns):
            norm.reset_parameters()
            attn._reset_parameters()
        self.out_norm.reset_parameters()

    def forward(self, dev_x: Tensor, dev_mask: Tensor | None = None) -> DeviceTokens:
        mask = torch.ones(dev_x.shape[0], dtype=torch.bool, device=dev_x.device) if dev_mask is None else dev_mask
        x = self.embed(dev_x)
        for norm, attn in zip(self.norms, self.attns):
            h = norm(x)[None]
            x = x + attn(h, h, h, key_padding_mask=~mask[None], need_weights=False)[0][0]
        tokens = self.out_norm(x) * mask[:, None].to(x.dtype)
        return DeviceTokens(tokens, mask, masked_mean(tokens, mask))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.device_feature_dim}->{self.hidden}, heads={self.heads}, "
                f"layers={self.layers})")
