"""Policy network of the learning agent: a GAT encoder over the op graph, sigma-pooled group
embeddings and a Transformer-XL strategy network giving (M+4)-way logits per group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Categorical
from torch_geometric.nn import GATConv, GATv2Conv
from torch_geometric.utils import scatter, to_undirected

from heterog.errors import HeterogError

__all__ = [
    "HEADS",
    "DeviceTokenEncoder",
    "DeviceTokens",
    "GATEncoder",
    "GroupPooling",
    "MaskedCategorical",
    "PolicyError",
    "RelativeMultiHeadAttention",
    "StrategyPolicy",
    "TransformerXL",
    "TokenPolicyHead",
    "TransformerXLLayer",
    "sinusoid_embedding",
]

N_DP_SCHEMES = 4  # actions M..M+3: DP-even-PS, DP-even-AR, DP-proportional-PS, DP-proportional-AR
GAT_CONVS = {"gat": GATConv, "gatv2": GATv2Conv}
GROUP_ACTIVATIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}
HEADS = ("fixed", "tokens")  # fixed: a linear (M+4)-way head; tokens: a pointer over device tokens


class PolicyError(HeterogError, ValueError):
    """A policy-network setting or input does not fit (sizes, heads, masks, action space)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PolicyError(message)


def _check_heads(what: str, hidden: int, heads: int) -> None:
    _require(heads >= 1, f"{what} heads must be at least 1, got {heads}")
    _require(hidden % heads == 0, f"hidden size {hidden} is not divisible by {heads} {what} heads")


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over the rows of ``x`` where ``mask`` is True (all rows when None). Shapes: ``(D, H)`` -> ``(H,)``."""
    if mask is None:
        return x.mean(dim=0)
    weights = mask.to(x.dtype)[:, None]
    return (x * weights).sum(dim=0) / weights.sum().clamp(min=1.0)


def sinusoid_embedding(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of (relative) positions, as in Transformer-XL: ``[sin(p w), cos(p w)]``
    with ``w_k = 1 / 10000^(2k / dim)``.

    Args:
        positions: positions (here relative distances ``i - j >= 0``), any float or int dtype.
        dim: embedding size, even.

    Shapes:
        positions ``(K,)`` -> ``(K, dim)``.
    """
    _require(dim % 2 == 0, f"sinusoid embedding size must be even, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    inv_freq = 1.0 / (10000.0 ** exponents)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# --------------------------------------------------------------------------------------------- encoder
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
        _require(conv in GAT_CONVS, f"unknown GAT conv {conv!r}; choose one of {sorted(GAT_CONVS)}")
        _require(layers >= 1, f"GAT layers must be at least 1, got {layers}")
        _check_heads("GAT", hidden, heads)
        self.op_feature_dim, self.device_feature_dim = op_feature_dim, device_feature_dim
        self.hidden, self.layers, self.heads, self.dropout, self.conv = hidden, layers, heads, dropout, conv
        self.op_proj = nn.Linear(op_feature_dim, hidden)
        self.dev_mlp = nn.Sequential(nn.Linear(device_feature_dim, hidden), nn.ELU(),
                                     nn.Linear(hidden, hidden))
        self.in_norm = nn.LayerNorm(hidden)
        conv_cls = GAT_CONVS[conv]
        self.convs = nn.ModuleList(
            conv_cls(hidden, hidden // heads, heads=heads, concat=True, dropout=dropout, add_self_loops=True)
            for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))

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
        _require(activation in GROUP_ACTIVATIONS,
                 f"unknown group activation {activation!r}; choose one of {sorted(GROUP_ACTIVATIONS)}")
        self.hidden, self.activation = hidden, activation
        self.weight = nn.Linear(hidden, hidden, bias=False)

    def reset_parameters(self) -> None:
        self.weight.reset_parameters()

    def forward(self, op_emb: Tensor, op_mask: Tensor, group_of: Tensor, group_mask: Tensor) -> Tensor:
        real_ops = op_mask.nonzero().squeeze(1)
        summed = scatter(self.weight(op_emb[real_ops]), group_of[real_ops], dim=0,
                         dim_size=group_mask.shape[0], reduce="sum")
        return GROUP_ACTIVATIONS[self.activation](summed) * group_mask.unsqueeze(1).to(summed.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hidden}, activation={self.activation})"


# -------------------------------------------------------------------------------------- Transformer-XL
class RelativeMultiHeadAttention(nn.Module):
    """Causal multi-head attention with Transformer-XL relative positions (Dai et al. 2019, Sec. 3.3).

    For query ``i`` (segment position, absolute ``i + m`` in the context) and key ``j`` of the
    context ``[memory; segment]`` (length ``K = m + L``), with ``R_d`` the sinusoid of distance
    ``d = i + m - j``::

        score(i, j) = ((q_i + u) . k_j + (q_i + v) . W_R R_d) / sqrt(d_head),  masked where d < 0

    ``u`` and ``v`` are the learned content and position biases (per head, per layer). The
    position term is computed for all distances ``0..K-1`` and then picked per (i, j) with an
    explicit gather of index ``i + m - j`` (the same result as the paper's "rel_shift" trick,
    without relying on reshape tricks).

    Args:
        hidden: model size ``d_model``, divisible by ``heads``.
        heads: attention heads.
        dropout: dropout on the attention probabilities.

    Shapes:
        query_in ``([B,] L, hidden)``, context ``([B,] K, hidden)`` whose last ``L`` rows are the
        queries' own inputs, pos_emb ``(K, hidden)`` (row d = distance d) -> ``([B,] L, hidden)``
        (``B`` sequences at once, optional).
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        _check_heads("Transformer-XL", hidden, heads)
        self.hidden, self.heads, self.head_dim, self.dropout = hidden, heads, hidden // heads, dropout
        self.q_net = nn.Linear(hidden, hidden, bias=False)
        self.kv_net = nn.Linear(hidden, 2 * hidden, bias=False)
        self.r_net = nn.Linear(hidden, hidden, bias=False)
        self.o_net = nn.Linear(hidden, hidden, bias=False)
        self.u = nn.Parameter(torch.empty(heads, self.head_dim))
        self.v = nn.Parameter(torch.empty(heads, self.head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.q_net, self.kv_net, self.r_net, self.o_net):
            linear.reset_parameters()
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)

    def forward(self, query_in: Tensor, context: Tensor, pos_emb: Tensor) -> Tensor:
        batched = query_in.dim() == 3
        if not batched:
            query_in, context = query_in[None], context[None]
        n_seq, q_len, k_len = query_in.shape[0], query_in.shape[1], context.shape[1]
        mem_len = k_len - q_len
        q = self.q_net(query_in).view(n_seq, q_len, self.heads, self.head_dim)
        k, v = self.kv_net(context).view(n_seq, k_len, 2, self.heads, self.head_dim).unbind(2)
        r = self.r_net(pos_emb).view(k_len, self.heads, self.head_dim)
        content = torch.einsum("bihd,bjhd->bhij", q + self.u, k)                    # (B, H, L, K)
        position_by_distance = torch.einsum("bihd,khd->bhik", q + self.v, r)       # (B, H, L, K): distance k
        distance = (torch.arange(q_len, device=q.device)[:, None] + mem_len
                    - torch.arange(k_len, device=q.device)[None, :])                # (L, K), at most K-1
        position = position_by_distance.gather(
            3, distance.clamp(min=0).expand(n_seq, self.heads, q_len, k_len))
        scores = (content + position) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(distance < 0, float("-inf"))                  # causal: only j <= i + m
        attn = F.dropout(scores.softmax(dim=-1), p=self.dropout, training=self.training)
        out = self.o_net(torch.einsum("bhij,bjhd->bihd", attn, v).reshape(n_seq, q_len, self.hidden))
        return out if batched else out[0]

    def step(self, query_in: Tensor, cache: dict[str, Tensor], r_by_distance: Tensor) -> Tensor:
        """:meth:`forward` for one new position whose context is everything in ``cache`` plus itself, for
        decoding: its key and value are appended to ``cache`` (``"k"``, ``"v"``: ``(B, K, H, d)``), and
        ``r_by_distance`` is ``r_net`` of the sinusoids of distances ``0..`` (at least ``K + 1`` rows).
        The same score as :meth:`forward`, as matrix products (decoding calls this once per position).

        Shapes: query_in ``(B, hidden)`` (already normalised) -> ``(B, hidden)``.
        """
        n_seq = query_in.shape[0]
        q = self.q_net(query_in).view(n_seq, self.heads, self.head_dim, 1)
        k, v = self.kv_net(query_in).view(n_seq, 2, self.heads, 1, self.head_dim).unbind(1)
        cache["k"] = k_all = torch.cat([cache["k"], k], dim=2)                          # (B, H, K, d)
        cache["v"] = v_all = torch.cat([cache["v"], v], dim=2)
        k_len = k_all.shape[2]
        r = r_by_distance[:k_len].flip(0).view(k_len, self.heads, self.head_dim).transpose(0, 1)  # key j: K-1-j
        scores = (torch.matmul(k_all, q + self.u[..., None]) + torch.matmul(r, q + self.v[..., None]))  # (B,H,K,1)
        attn = F.dropout((scores[..., 0] / math.sqrt(self.head_dim)).softmax(dim=-1), p=self.dropout,
                         training=self.training)
        return self.o_net(torch.matmul(attn[:, :, None], v_all).reshape(n_seq, self.hidden))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hidden}, heads={self.heads}, dropout={self.dropout})"


class TransformerXLLayer(nn.Module):
    """One pre-LayerNorm Transformer-XL layer: relative attention over ``[memory; segment]``, then a
    position-wise FFN (``hidden -> 4 hidden -> hidden``, ReLU), each with a residual connection.

    Args:
        hidden: model size.
        heads: attention heads.
        dropout: dropout on attention probabilities, the attention output and the FFN.

    Shapes:
        x ``([B,] L, hidden)``, memory ``([B,] m, hidden)`` (this layer's inputs at earlier positions),
        pos_emb ``(m + L, hidden)`` -> ``([B,] L, hidden)``.
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.hidden, self.heads, self.dropout = hidden, heads, dropout
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = RelativeMultiHeadAttention(hidden, heads, dropout)
        self.ff_norm = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Dropout(dropout),
                                nn.Linear(4 * hidden, hidden))

    def reset_parameters(self) -> None:
        self.attn_norm.reset_parameters()
        self.attn.reset_parameters()
        self.ff_norm.reset_parameters()
        for module in self.ff:
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: Tensor, memory: Tensor, pos_emb: Tensor) -> Tensor:
        context = self.attn_norm(torch.cat([memory, x], dim=-2))
        x = x + F.dropout(self.attn(context[..., memory.shape[-2]:, :], context, pos_emb),
                          p=self.dropout, training=self.training)
        return x + F.dropout(self.ff(self.ff_norm(x)), p=self.dropout, training=self.training)

    def step(self, x: Tensor, cache: dict[str, Tensor], r_by_distance: Tensor) -> Tensor:
        """:meth:`forward` for one new position after the positions cached in ``cache`` (see
        :meth:`RelativeMultiHeadAttention.step`). Shapes: x ``(B, hidden)`` -> ``(B, hidden)``."""
        x = x + F.dropout(self.attn.step(self.attn_norm(x), cache, r_by_distance), p=self.dropout,
                          training=self.training)
        return x + F.dropout(self.ff(self.ff_norm(x)), p=self.dropout, training=self.training)

    def memory_cache(self, memory: Tensor) -> dict[str, Tensor]:
        """Keys and values of a memory ``(B, m, hidden)`` for :meth:`step`."""
        n_seq, m = memory.shape[:2]
        kv = self.attn.kv_net(self.attn_norm(memory)).view(n_seq, m, 2, self.heads, self.attn.head_dim)
        return {"k": kv[:, :, 0].transpose(1, 2), "v": kv[:, :, 1].transpose(1, 2)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hidden}, heads={self.heads}, ffn={4 * self.hidden})"


class TransformerXL(nn.Module):
    """Transformer-XL over one sequence, processed in segments with a recurrent memory.

    The sequence is cut into segments of ``segment_len``. Each layer keeps as memory its own
    inputs at the last ``mem_len`` earlier positions (``cat(memory, segment)[-mem_len:]``, detached
    as in Transformer-XL unless ``detach_mem=False``), and a segment attends causally to
    ``[memory; segment]`` with relative positions. With ``mem_len >= sequence length`` every
    position sees all earlier positions, so the output equals one segment over the whole
    sequence (detaching only changes gradients, not values). A final LayerNorm closes the
    pre-norm stack.

    Args:
        hidden: model size, even and divisible by ``heads``.
        layers: number of layers (the paper uses 8).
        heads: attention heads.
        segment_len: positions per segment, at least 1.
        mem_len: cached positions per layer, at least 0.
        dropout: dropout inside the layers.
        detach_mem: stop gradients through the memory (Transformer-XL's choice).

    Shapes:
        x ``([B,] S, hidden)`` -> ``([B,] S, hidden)``; position ``s`` depends only on positions
        ``<= s``.
    """

    def __init__(self, hidden: int, layers: int, heads: int, segment_len: int, mem_len: int,
                 dropout: float = 0.0, detach_mem: bool = True) -> None:
        super().__init__()
        _require(layers >= 1, f"Transformer-XL layers must be at least 1, got {layers}")
        _check_heads("Transformer-XL", hidden, heads)
        _require(hidden % 2 == 0, f"hidden size {hidden} must be even for sinusoidal relative positions")
        _require(segment_len >= 1, f"segment_len must be at least 1, got {segment_len}")
        _require(mem_len >= 0, f"mem_len must be at least 0, got {mem_len}")
        self.hidden, self.layers, self.heads = hidden, layers, heads
        self.segment_len, self.mem_len = segment_len, mem_len
        self.dropout, self.detach_mem = dropout, detach_mem
        self.blocks = nn.ModuleList(TransformerXLLayer(hidden, heads, dropout) for _ in range(layers))
        self.out_norm = nn.LayerNorm(hidden)

    def reset_parameters(self) -> None:
        for block in self.blocks:
            block.reset_parameters()
        self.out_norm.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        memories = [x.new_zeros(*x.shape[:-2], 0, self.hidden) for _ in self.blocks]
        outputs = []
        for start in range(0, x.shape[-2], self.segment_len):
            h = x[..., start:start + self.segment_len, :]
            pos_emb = self._positions(memories[0].shape[-2] + h.shape[-2], x)
            for i, block in enumerate(self.blocks):
                layer_in, memory = h, memories[i]
                h = block(layer_in, memory, pos_emb)
                memories[i] = self._kept(memory, layer_in)
            outputs.append(h)
        if not outputs:
            return self.out_norm(x)
        return self.out_norm(torch.cat(outputs, dim=-2))

    def _positions(self, context_len: int, like: Tensor) -> Tensor:
        return sinusoid_embedding(torch.arange(context_len, device=like.device), self.hidden).to(like.dtype)

    def _kept(self, memory: Tensor, layer_in: Tensor) -> Tensor:
        """A layer's memory for the next segment: its last ``mem_len`` inputs (detached if so set)."""
        if self.mem_len == 0:
            return memory
        kept = torch.cat([memory, layer_in], dim=-2)[..., -self.mem_len:, :]
        return kept.detach() if self.detach_mem else kept

    def start_decoding(self, n_seq: int, like: Tensor) -> dict[str, Any]:
        """State for :meth:`decode_step`: ``n_seq`` sequences decoded one position at a time."""
        sinusoids = self._positions(self.mem_len + self.segment_len, like)
        memories = [like.new_zeros(n_seq, 0, self.hidden) for _ in self.blocks]
        return {"memories": memories, "segment": [[] for _ in self.blocks], "position": 0,
                "caches": [block.memory_cache(m) for block, m in zip(self.blocks, memories)],
                "r": [block.attn.r_net(sinusoids) for block in self.blocks]}

    def decode_step(self, state: dict[str, Any], x: Tensor) -> Tensor:
        """The output at the next position given its input, for autoregressive decoding (the input may
        depend on earlier outputs). Positions are cut into the same segments, with the same memories,
        as :meth:`forward`, so decoding a sequence step by step gives ``forward`` of the whole sequence;
        keys and values of earlier positions are cached.

        Shapes: x ``(B, hidden)`` -> ``(B, hidden)``.
        """
        if state["position"] == self.segment_len:          # segment boundary: roll the memories
            for i, (block, pieces) in enumerate(zip(self.blocks, state["segment"])):
                state["memories"][i] = self._kept(state["memories"][i], torch.stack(pieces, dim=1))
                state["caches"][i] = block.memory_cache(state["memories"][i])
                pieces.clear()
            state["position"] = 0
        h = x
        for i, block in enumerate(self.blocks):
            state["segment"][i].append(h)
            h = block.step(h, state["caches"][i], state["r"][i])
        state["position"] += 1
        return self.out_norm(h)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.hidden}, layers={self.layers}, heads={self.heads}, "
                f"segment_len={self.segment_len}, mem_len={self.mem_len}, detach_mem={self.detach_mem})")


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
        _require(device_feature_dim >= 1, f"device_feature_dim must be at least 1, got {device_feature_dim}")
        _require(layers >= 0, f"device token layers must be at least 0, got {layers}")
        _check_heads("device token", hidden, heads)
        self.device_feature_dim, self.hidden, self.heads, self.layers = device_feature_dim, hidden, heads, layers
        self.embed = nn.Sequential(nn.Linear(device_feature_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.attns = nn.ModuleList(nn.MultiheadAttention(hidden, heads, batch_first=True) for _ in range(layers))
        self.out_norm = nn.LayerNorm(hidden)

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


class TokenPolicyHead(nn.Module):
    """Logits over ``[M model-parallel, 4 data-parallel]`` for a cluster of any size ``M``.

    Model parallelism on device ``d`` is a pointer: ``(W_q s_g) . (W_k t_d) / sqrt(hidden)`` from a
    group's state ``s_g`` to device token ``t_d``. The four DP schemes are scored by an MLP of
    ``[s_g; c]`` with ``c`` the pooled cluster embedding. Padding devices get ``-inf`` (never any
    probability) and are dropped from the output, so column ``d < M`` is the ``d``-th real device.
    The output layers start near zero (``init_scale``), so a fresh policy is close to uniform.

    Args:
        hidden: size of group states and device tokens.
        init_scale: gain of the output layers' orthogonal initialisation.

    Shapes:
        states ``(..., G, hidden)``, devices tokens ``(D, hidden)`` with ``M`` real ones
        -> ``(..., G, M + 4)``.
    """

    def __init__(self, hidden: int, init_scale: float = 0.01) -> None:
        super().__init__()
        _require(hidden >= 1, f"hidden size must be at least 1, got {hidden}")
        _require(init_scale > 0, f"init_scale must be positive, got {init_scale}")
        self.hidden, self.init_scale = hidden, init_scale
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.dp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ELU(), nn.Linear(hidden, N_DP_SCHEMES))
        self.reset_parameters()

    @property
    def dp_bias(self) -> Tensor:
        """The bias of the four data-parallel logits."""
        return self.dp[-1].bias

    def reset_parameters(self) -> None:
        self.key.reset_parameters()
        self.dp[0].reset_parameters()
        nn.init.orthogonal_(self.query.weight, gain=self.init_scale)
        nn.init.zeros_(self.query.bias)
        nn.init.orthogonal_(self.dp[-1].weight, gain=self.init_scale)
        nn.init.zeros_(self.dp[-1].bias)

    def forward(self, states: Tensor, devices: DeviceTokens) -> Tensor:
        scores = torch.einsum("...gh,dh->...gd", self.query(states), self.key(devices.tokens))
        scores = (scores / math.sqrt(self.hidden)).masked_fill(~devices.mask, float("-inf"))
        model_parallel = scores[..., devices.mask.nonzero().squeeze(1)]
        cluster = devices.pooled.expand(*states.shape[:-1], self.hidden)
        return torch.cat([model_parallel, self.dp(torch.cat([states, cluster], dim=-1))], dim=-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hidden}, pointer over device tokens + {N_DP_SCHEMES} DP scores)"


# ------------------------------------------------------------------------------------- distribution
def most_likely_actions(logits: Tensor) -> Tensor:
    """Each group's most likely decision: model parallelism (the probabilities of its ``M`` device
    actions summed) or one of the four DP schemes, whichever is most likely (DP on a tie); for model
    parallelism, its most likely device.

    Why not the argmax over the ``M + 4`` actions: a policy that is sure a group belongs on one device
    but cannot tell equivalent devices apart (eight identical GPUs) gives each an eighth of that mass,
    and the argmax never places it there. Drawing the decision, then the device, is the same
    distribution as drawing an action, so only the greedy plan changes.

    Shapes: ``(..., M + 4)`` -> ``(...)``.
    """
    devices, dp = logits[..., :-N_DP_SCHEMES], logits[..., -N_DP_SCHEMES:]
    best_dp = dp.max(dim=-1)
    model_parallel = torch.logsumexp(devices, dim=-1) > best_dp.values
    return torch.where(model_parallel, devices.argmax(dim=-1), devices.shape[-1] + best_dp.indices)


class MaskedCategorical(Categorical):
    """Independent categorical actions, one per group, where padding groups do not count.

    Padding rows are replaced by uniform logits, ``log_prob`` sums over real groups only (the log
    probability of a whole strategy), ``entropy`` is the mean over real groups, and sampled or
    modal actions of padding groups are 0.

    Args:
        logits: unnormalised log probabilities.
        mask: True for real groups.

    Shapes:
        logits ``(G, A)``, mask ``(G,)``; ``sample(k)`` -> ``(k, G)``; ``log_prob`` of ``(..., G)``
        -> ``(...)``; ``entropy()`` -> ``()``; ``mode`` -> ``(G,)``.
    """

    def __init__(self, logits: Tensor, mask: Tensor) -> None:
        _require(logits.dim() == 2, f"logits must be (groups, actions), got shape {tuple(logits.shape)}")
        _require(mask.shape == logits.shape[:1] and mask.dtype == torch.bool,
                 f"mask must be a bool tensor of shape ({logits.shape[0]},), "
                 f"got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        super().__init__(logits=logits.masked_fill(~mask.unsqueeze(1), 0.0), validate_args=False)

    @property
    def n_real(self) -> int:
        """Number of real (non-padding) groups."""
        return int(self.mask.sum())

    def sample(self, sample_shape: int | torch.Size | tuple[int, ...] = (),
               generator: torch.Generator | None = None) -> Tensor:
        """Draw actions for every group; padding groups get action 0.

        Args:
            sample_shape: ``k`` (an int) or a shape of independent draws.
            generator: optional ``torch.Generator`` for reproducible draws.
        """
        shape = torch.Size([sample_shape]) if isinstance(sample_shape, int) else torch.Size(sample_shape)
        n_draws, n_groups = shape.numel(), self.mask.shape[0]
        real = self.mask.nonzero().squeeze(1)
        actions = torch.zeros(n_draws, n_groups, dtype=torch.long, device=self.logits.device)
        if n_draws > 0 and real.numel() > 0:
            with torch.no_grad():
                draws = torch.multinomial(self.probs[real], n_draws, replacement=True, generator=generator)
            actions[:, real] = draws.T
        return actions.reshape(shape + (n_groups,))

    def log_prob(self, value: Tensor) -> Tensor:
        n_actions = self.logits.shape[-1]
        _require(value.shape[-1:] == self.mask.shape,
                 f"actions must end with the group dimension {self.mask.shape[0]}, got {tuple(value.shape)}")
        out_of_range = ((value < 0) | (value >= n_actions)) & self.mask
        if bool(out_of_range.any()):
            bad = out_of_range.nonzero()[0].tolist()
            raise PolicyError(f"action {int(value[tuple(bad)])} of group {bad[-1]} is out of range "
                              f"0..{n_actions - 1}")
        safe = torch.where(self.mask, value, torch.zeros_like(value)).long()
        per_group = super().log_prob(safe)
        return (per_group * self.mask).sum(dim=-1)

    def entropy(self) -> Tensor:
        return (super().entropy() * self.mask).sum() / self.mask.sum().clamp(min=1)

    @property
    def mode(self) -> Tensor:
        """Each real group's most likely decision (:func:`most_likely_actions`); padding groups 0."""
        return torch.where(self.mask, most_likely_actions(self.logits), torch.zeros_like(self.mask, dtype=torch.long))


# ------------------------------------------------------------------------------------------- policy
class StrategyPolicy(nn.Module):
    r"""HeteroG's policy: GAT op encoder -> group embeddings -> Transformer-XL -> (M+4) logits per group.

    1. :class:`GATEncoder` embeds every op from its features, its graph neighbourhood and the
       cluster (mean-pooled device embedding added to each op).
    2. :class:`GroupPooling` gives ``g_n = sigma(sum_{o in n} W e_o)`` per group.
    3. The real groups, in group-id order, form a dense sequence (padding groups are removed, so
       they never shift relative positions or enter attention) that :class:`TransformerXL` reads
       in segments with memory; the logits of group ``n`` depend on groups ``<= n`` only through
       the strategy network (the GAT is bidirectional over the graph).
    4. A linear head gives ``M + 4`` logits per group: ``0..M-1`` model parallel on that device,
       ``M..M+3`` DP-even-PS, DP-even-AR, DP-proportional-PS, DP-proportional-AR. It starts near
       zero, so the first policy is close to uniform. Padding groups get all-zero logits.
    5. With ``autoregressive=True`` the choices are made one group after another: the Transformer-XL
       input of group ``n`` is ``g_n + E[a_{n-1}]`` (``E`` an action embedding, a start token for the
       first group), so each group's logits depend on the actions of all earlier groups (how much
       each device already holds). Such a policy has no action-independent logits: use
       :meth:`sample_actions` (decoding, group by group) and :meth:`action_logits` (the logits along
       given strategies, all positions at once); ``forward`` and ``distribution`` refuse it.
    6. With ``head="tokens"`` step 4 is a :class:`TokenPolicyHead` over the device tokens of
       :class:`DeviceTokenEncoder` instead: one policy scores clusters of any size up to
       ``n_actions - 4`` devices (``dev_x`` may be padded, ``dev_mask`` marks the real devices; the op
       features must not depend on the cluster: ``envs.features`` layout ``"device-free"``). The
       action methods then take ``devices=`` :meth:`embed_devices` of the cluster at hand.

    Args:
        op_feature_dim: per-op feature size ``F_op``.
        device_feature_dim: per-device feature size ``F_dev``.
        n_actions: ``M + 4`` for a cluster of ``M`` devices (``head="tokens"``: for clusters of at most
            ``M`` devices).
        hidden: embedding size of ops, groups and the Transformer-XL.
        gat_layers, gat_heads: GAT depth and heads (paper: 12 x 8).
        txl_layers, txl_heads: Transformer-XL depth and heads (paper: 8 layers).
        segment_len, mem_len: Transformer-XL segment length and memory length.
        dropout: dropout everywhere (0 for policy-gradient training by default).
        gat_conv: ``"gat"`` (paper) or ``"gatv2"``.
        group_activation: ``"sigmoid"`` (paper) or ``"tanh"``.
        detach_mem: detach the Transformer-XL memory (gradients stay within a segment).
        autoregressive: condition each group's choice on the earlier groups' actions (step 5).
        head: ``"fixed"`` (the paper's linear head) or ``"tokens"`` (step 6; not autoregressive).
        device_layers: self-attention blocks among the device tokens (``head="tokens"`` only).

    Shapes:
        op_x ``(N, F_op)`` float, op_mask ``(N,)`` bool, edge_index ``(2, E)`` int64,
        edge_mask ``(E,)`` bool, group_of ``(N,)`` int64 (padding ops: any value, e.g. -1),
        group_mask ``(G,)`` bool, dev_x ``(D, F_dev)`` float, dev_mask ``(D,)`` bool or None (tokens
        head only; None: all real) -> logits ``(G, M + 4)`` for the ``M`` real devices.
    """

    def __init__(self, op_feature_dim: int, device_feature_dim: int, n_actions: int, hidden: int = 64,
                 gat_layers: int = 2, gat_heads: int = 4, txl_layers: int = 2, txl_heads: int = 4,
                 segment_len: int = 64, mem_len: int = 64, dropout: float = 0.0, gat_conv: str = "gat",
                 group_activation: str = "sigmoid", detach_mem: bool = True,
                 autoregressive: bool = False, head: str = "fixed", device_layers: int = 1) -> None:
        super().__init__()
        _require(op_feature_dim >= 1, f"op_feature_dim must be at least 1, got {op_feature_dim}")
        _require(device_feature_dim >= 1, f"device_feature_dim must be at least 1, got {device_feature_dim}")
        _require(n_actions >= N_DP_SCHEMES + 1,
                 f"n_actions must be M + {N_DP_SCHEMES} for M >= 1 devices, got {n_actions}")
        _require(hidden >= 2, f"hidden size must be at least 2, got {hidden}")
        _require(0.0 <= dropout < 1.0, f"dropout must be in [0, 1), got {dropout}")
        _require(head in HEADS, f"unknown policy head {head!r}; choose one of {list(HEADS)}")
        _require(not (head == "tokens" and autoregressive),
                 "the device-token head is not autoregressive; use head=fixed for autoregressive=True")
        self._config: dict[str, Any] = {
            "op_feature_dim": op_feature_dim, "device_feature_dim": device_feature_dim,
            "n_actions": n_actions,
            "hidden": hidden, "gat_layers": gat_layers, "gat_heads": gat_heads, "txl_layers": txl_layers,
            "txl_heads": txl_heads, "segment_len": segment_len, "mem_len": mem_len, "dropout": dropout,
            "gat_conv": gat_conv, "group_activation": group_activation, "detach_mem": detach_mem,
            "autoregressive": autoregressive}
        if head != "fixed":  # a fixed-head config stays as it was (older checkpoints have no "head")
            self._config.update({"head": head, "device_layers": device_layers})
        self.head_kind = head
        self.n_actions = n_actions
        self.op_feature_dim, self.device_feature_dim, self.hidden = op_feature_dim, device_feature_dim, hidden
        self.encoder = GATEncoder(op_feature_dim, device_feature_dim, hidden, gat_layers, gat_heads, dropout,
                                  gat_conv)
        self.pooling = GroupPooling(hidden, group_activation)
        self.strategy = TransformerXL(hidden, txl_layers, txl_heads, segment_len, mem_len, dropout,
                                      detach_mem)
        self.devices = DeviceTokenEncoder(device_feature_dim, hidden, txl_heads, device_layers) \
            if head == "tokens" else None
        self.head = nn.Linear(hidden, n_actions) if head == "fixed" else TokenPolicyHead(hidden)
        self.autoregressive = autoregressive
        # the earlier group's action (row n_actions: the start token), added to a group's embedding
        self.action_emb = nn.Embedding(n_actions + 1, hidden) if autoregressive else None
        self.reset_parameters()

    # ---- construction
    @classmethod
    def paper(cls, op_feature_dim: int, device_feature_dim: int, n_actions: int,
              **overrides: Any) -> StrategyPolicy:
        """The paper's sizes: 12 GAT layers x 8 heads, 8 Transformer-XL layers (hidden 256, 8 heads;
        the paper does not give these, nor segment or memory length: 64 and 128 here)."""
        settings = {"hidden": 256, "gat_layers": 12, "gat_heads": 8, "txl_layers": 8, "txl_heads": 8,
                    "segment_len": 64, "mem_len": 128}
        return cls(op_feature_dim, device_feature_dim, n_actions, **{**settings, **overrides})

    @classmethod
    def small(cls, op_feature_dim: int, device_feature_dim: int, n_actions: int,
              **overrides: Any) -> StrategyPolicy:
        """A CPU-sized policy: hidden 64, 2 GAT layers x 4 heads, 2 Transformer-XL layers x 4 heads."""
        settings = {"hidden": 64, "gat_layers": 2, "gat_heads": 4, "txl_layers": 2, "txl_heads": 4,
                    "segment_len": 64, "mem_len": 64}
        return cls(op_feature_dim, device_feature_dim, n_actions, **{**settings, **overrides})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> StrategyPolicy:
        """Rebuild from :attr:`config` (e.g. stored in a checkpoint next to the state dict)."""
        return cls(**config)

    @property
    def config(self) -> dict[str, Any]:
        """The constructor arguments, for checkpoints."""
        return dict(self._config)

    @property
    def n_devices(self) -> int:
        """``M``, the number of devices the action space is built for (tokens head: the most devices)."""
        return self.n_actions - N_DP_SCHEMES

    @property
    def feature_layout(self) -> str:
        """The op feature layout this policy reads (``envs.features.op_feature_dim``): per-device columns
        for the fixed head, device-free for the tokens head."""
        return "per-device" if self.head_kind == "fixed" else "device-free"

    def fits_devices(self, n_devices: int) -> bool:
        """Whether this policy scores a cluster of ``n_devices`` (any size up to its maximum for tokens)."""
        if self.head_kind == "tokens":
            return 1 <= n_devices <= self.n_devices
        return n_devices == self.n_devices

    def add_data_parallel_bias(self, bias: float) -> None:
        """Add ``bias`` to the four data-parallel logits' bias (in place, no gradient)."""
        with torch.no_grad():
            if self.head_kind == "tokens":
                self.head.dp_bias.add_(bias)
            else:
                self.head.bias[self.n_actions - N_DP_SCHEMES:] += bias

    def reset_parameters(self) -> None:
        self.encoder.reset_parameters()
        self.pooling.reset_parameters()
        self.strategy.reset_parameters()
        if self.devices is not None:
            self.devices.reset_parameters()
            self.head.reset_parameters()
        else:
            nn.init.orthogonal_(self.head.weight, gain=0.01)
            nn.init.zeros_(self.head.bias)
        if self.action_emb is not None:
            nn.init.normal_(self.action_emb.weight, std=0.1)

    # ---- forward pieces
    def check_inputs(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> None:
        """Raise :class:`PolicyError` naming the first input that does not fit this policy."""
        n_ops = op_x.shape[0] if op_x.dim() == 2 else -1
        _require(op_x.dim() == 2 and op_x.shape[1] == self.op_feature_dim,
                 f"op_x must be (N, {self.op_feature_dim}), got {tuple(op_x.shape)}")
        _require(dev_x.dim() == 2 and dev_x.shape[1] == self.device_feature_dim,
                 f"dev_x must be (M, {self.device_feature_dim}), got {tuple(dev_x.shape)}")
        self.check_devices(dev_x, dev_mask)
        for name, tensor, shape, dtype in (("op_mask", op_mask, (n_ops,), torch.bool),
                                           ("group_of", group_of, (n_ops,), torch.long),
                                           ("edge_mask", edge_mask, (edge_index.shape[-1],), torch.bool),
                                           ("group_mask", group_mask, (group_mask.shape[0],), torch.bool)):
            _require(tuple(tensor.shape) == shape and tensor.dtype == dtype,
                     f"{name} must be a {dtype} tensor of shape {shape}, "
                     f"got {tensor.dtype} {tuple(tensor.shape)}")
        _require(edge_index.dim() == 2 and edge_index.shape[0] == 2 and edge_index.dtype == torch.long,
                 f"edge_index must be an int64 tensor of shape (2, E), got {edge_index.dtype} "
                 f"{tuple(edge_index.shape)}")
        real_edges = edge_index[:, edge_mask]
        outside = (real_edges < 0) | (real_edges >= n_ops)
        if bool(outside.any()):
            e = int(outside.any(0).nonzero()[0])
            raise PolicyError(f"real edge {real_edges[:, e].tolist()} points outside ops 0..{n_ops - 1}")
        to_padding = ~op_mask[real_edges]
        if bool(to_padding.any()):
            e = int(to_padding.any(0).nonzero()[0])
            raise PolicyError(f"real edge {real_edges[:, e].tolist()} touches a padding op (op_mask False)")
        groups = group_of[op_mask]
        n_groups = group_mask.shape[0]
        bad = (groups < 0) | (groups >= n_groups)
        bad[~bad] = ~group_mask[groups[~bad]]
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            op = int(op_mask.nonzero()[i])
            raise PolicyError(f"real op {op} is in group {int(groups[i])}, which is not a real group "
                              f"(0..{n_groups - 1} with group_mask True)")

    def check_devices(self, dev_x: Tensor, dev_mask: Tensor | None) -> None:
        """Raise :class:`PolicyError` when the device rows (and mask) do not fit this policy's head."""
        rows = dev_x.shape[0]
        if dev_mask is not None:
            _require(dev_mask.dtype == torch.bool and tuple(dev_mask.shape) == (rows,),
                     f"dev_mask must be a torch.bool tensor of shape ({rows},), got {dev_mask.dtype} "
                     f"{tuple(dev_mask.shape)}")
        m = rows if dev_mask is None else int(dev_mask.sum())
        if self.head_kind == "fixed":
            _require(dev_mask is None or m == rows,
                     f"the fixed head takes no padded devices, got dev_mask with {m} of {rows} real")
            _require(m + N_DP_SCHEMES == self.n_actions,
                     f"dev_x has {m} devices, so {m + N_DP_SCHEMES} actions; this policy has {self.n_actions} "
                     f"(built for {self.n_devices} devices)")
        else:
            _require(1 <= m <= self.n_devices and rows <= self.n_devices,
                     f"dev_x has {m} real devices in {rows} rows; this device-token policy takes 1 to "
                     f"{self.n_devices} devices")

    def encode_ops(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                   dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        """Op embeddings from the GAT encoder. Shapes: -> ``(N, hidden)``."""
        return self.encoder(op_x, op_mask, edge_index, edge_mask, dev_x, dev_mask)

    def embed_groups(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        """Group embeddings ``sigma(sum W e_o)`` (padding groups zero); inputs are checked.

        Shapes: -> ``(G, hidden)``.
        """
        self.check_inputs(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        op_emb = self.encode_ops(op_x, op_mask, edge_index, edge_mask, dev_x, dev_mask)
        return self.pooling(op_emb, op_mask, group_of, group_mask)

    def embed_devices(self, dev_x: Tensor, dev_mask: Tensor | None = None) -> DeviceTokens | None:
        """The device tokens the tokens head points at (None for the fixed head, which needs none).

        Shapes: dev_x ``(D, F_dev)``, dev_mask ``(D,)`` or None -> tokens ``(D, hidden)``.
        """
        if self.devices is None:
            return None
        self.check_devices(dev_x, dev_mask)
        return self.devices(dev_x, dev_mask)

    def n_actions_for(self, devices: DeviceTokens | None) -> int:
        """``M + 4`` for the cluster at hand (``devices``: :meth:`embed_devices`; None: the fixed head's)."""
        return self.n_actions if devices is None else devices.n_devices + N_DP_SCHEMES

    def _head(self, states: Tensor, devices: DeviceTokens | None) -> Tensor:
        if self.head_kind == "fixed":
            return self.head(states)
        _require(devices is not None, "the device-token head needs devices=policy.embed_devices(dev_x, dev_mask)")
        return self.head(states, devices)

    def encode_strategy(self, group_emb: Tensor, group_mask: Tensor) -> Tensor:
        """Transformer-XL states of the real groups in id order, scattered back (padding rows zero).

        A value head for PPO can pool these. Shapes: group_emb ``(G, hidden)`` -> ``(G, hidden)``.
        """
        real = group_mask.nonzero().squeeze(1)
        states = self.strategy(group_emb[real])
        return group_emb.new_zeros(group_emb.shape).index_copy(0, real, states)

    def logits_from_group_embeddings(self, group_emb: Tensor, group_mask: Tensor,
                                     devices: DeviceTokens | None = None) -> Tensor:
        """Strategy network and head; padding rows are zero. ``devices``: the tokens head's
        :meth:`embed_devices` (the fixed head takes None).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> ``(G, M + 4)``.
        """
        logits = self._head(self.encode_strategy(group_emb, group_mask), devices)
        return logits.masked_fill(~group_mask.unsqueeze(1), 0.0)

    def forward(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        self._require_independent("forward")
        group_emb = self.embed_groups(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        return self.logits_from_group_embeddings(group_emb, group_mask, self.embed_devices(dev_x, dev_mask))

    def distribution(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor,
                     dev_mask: Tensor | None = None) -> MaskedCategorical:
        """The per-group action distribution with padding groups masked (see :class:`MaskedCategorical`)."""
        logits = self(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        return MaskedCategorical(logits, group_mask)

    def _require_independent(self, what: str) -> None:
        _require(not self.autoregressive,
                 f"{what} gives action-independent logits, which an autoregressive policy does not have; "
                 "use sample_actions and action_logits")

    # ---- strategies (both kinds of policy)
    def action_logits(self, group_emb: Tensor, group_mask: Tensor, actions: Tensor,
                      devices: DeviceTokens | None = None) -> Tensor:
        """The logits each group's choice was drawn from in the strategies ``actions`` (for an
        autoregressive policy, given the earlier groups' actions in that strategy; otherwise the same
        logits for every strategy). Padding rows are zero.

        ``devices``: the tokens head's :meth:`embed_devices` (None for the fixed head).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)``, actions ``(K, G)`` -> ``(K, G, M + 4)``.
        """
        n_seq = actions.shape[0]
        if not self.autoregressive:
            return self.logits_from_group_embeddings(group_emb, group_mask, devices).expand(n_seq, -1, -1)
        real = group_mask.nonzero().squeeze(1)
        earlier = torch.cat([actions.new_full((n_seq, 1), self.n_actions), actions[:, real[:-1]]], dim=1)
        states = self.strategy(group_emb[real][None] + self.action_emb(earlier))         # (K, S, hidden)
        logits = group_emb.new_zeros(n_seq, group_emb.shape[0], self.n_actions)
        return logits.index_copy(1, real, self.head(states))

    def sample_actions(self, group_emb: Tensor, group_mask: Tensor, n: int, *,
                       generator: torch.Generator | None = None, offsets: Tensor | None = None,
                       greedy: bool = False, devices: DeviceTokens | None = None) -> Tensor:
        """``n`` strategies: each group's action drawn (or, ``greedy``, its most likely decision:
        :func:`most_likely_actions`) from its
        logits plus the strategy's ``offsets`` (one offset per action shared by all groups of a strategy;
        None: none). An autoregressive policy decodes group by group; padding groups get action 0.

        ``devices``: the tokens head's :meth:`embed_devices` (None for the fixed head).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)``, offsets ``(n, M + 4)`` -> ``(n, G)``.
        """
        if not self.autoregressive:
            return self.draw(self.logits_from_group_embeddings(group_emb, group_mask, devices) if n else None,
                             group_mask, n, generator=generator, offsets=offsets, greedy=greedy)
        actions = torch.zeros(n, group_mask.shape[0], dtype=torch.long, device=group_emb.device)
        if n == 0:
            return actions
        real = group_mask.nonzero().squeeze(1)
        state = self.strategy.start_decoding(n, group_emb)
        earlier = actions.new_full((n,), self.n_actions)
        for g in real.tolist():
            step_logits = self.head(self.strategy.decode_step(state, group_emb[g][None] + self.action_emb(earlier)))
            if offsets is not None:
                step_logits = step_logits + offsets
            earlier = self._draw(step_logits[:, None], None, generator, greedy)[:, 0]
            actions[:, g] = earlier
        return actions

    def draw(self, logits: Tensor | None, group_mask: Tensor, n: int, *, generator: torch.Generator | None = None,
             offsets: Tensor | None = None, greedy: bool = False) -> Tensor:
        """``n`` strategies from an independent policy's logits (:meth:`logits_from_group_embeddings`), drawn
        as :meth:`sample_actions` draws them, so that one pass of the strategy network can serve the draws
        and the update (``logits`` may be None when ``n`` is 0).

        Shapes: logits ``(G, M + 4)``, group_mask ``(G,)``, offsets ``(n, M + 4)`` -> ``(n, G)``.
        """
        self._require_independent("draw")
        if n == 0:
            return torch.zeros(0, group_mask.shape[0], dtype=torch.long, device=group_mask.device)
        if offsets is None:
            dist = MaskedCategorical(logits, group_mask)
            return dist.mode[None].expand(n, -1).clone() if greedy else dist.sample(n, generator=generator)
        return self._draw(logits[None] + offsets[:, None], group_mask, generator, greedy)

    @staticmethod
    def _draw(logits: Tensor, group_mask: Tensor | None, generator: torch.Generator | None,
              greedy: bool) -> Tensor:
        """One action per (strategy, group) from logits ``(n, G, A)``; padding groups 0. -> ``(n, G)``."""
        n, n_groups, n_actions = logits.shape
        if greedy:
            out = most_likely_actions(logits)
        else:
            probs = logits.softmax(dim=-1).reshape(n * n_groups, n_actions)
            out = torch.multinomial(probs, 1, generator=generator).reshape(n, n_groups)
        return out if group_mask is None else out * group_mask

    def __repr__(self) -> str:
        c = self._config
        n_params = sum(p.numel() for p in self.parameters())
        return (f"{type(self).__name__}(ops={c['op_feature_dim']}, devices={c['device_feature_dim']}, "
                f"n_actions={c['n_actions']}, hidden={c['hidden']}, "
                f"gat={c['gat_layers']}x{c['gat_heads']} heads ({c['gat_conv']}), "
                f"txl={c['txl_layers']}x{c['txl_heads']} heads (segment {c['segment_len']}, "
                f"memory {c['mem_len']}), group={c['group_activation']}, dropout={c['dropout']}, "
                f"autoregressive={c['autoregressive']}, head={self.head_kind}, "
                f"params={n_params:,})")
