"""The policy's strategy network: a Transformer-XL (Dai et al. 2019) that reads the group embeddings in
order, in segments with a recurrent memory, with relative positions; batched or one position at a time."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agents.networks.common import Modules, head_count_problems, raise_problems, require


def sinusoid_embedding(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of (relative) positions, as in Transformer-XL: ``[sin(p w), cos(p w)]``
    with ``w_k = 1 / 10000^(2k / dim)``.

    Args:
        positions: positions (here relative distances ``i - j >= 0``), any float or int dtype.
        dim: embedding size, even.

    Shapes:
        positions ``(K,)`` -> ``(K, dim)``.
    """
    require(dim % 2 == 0, f"sinusoid embedding size must be even, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    inv_freq = 1.0 / (10000.0 ** exponents)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


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
        raise_problems(head_count_problems("Transformer-XL", hidden, heads))
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
        raise_problems(self.problems(hidden, layers, heads, segment_len, mem_len))
        self.hidden, self.layers, self.heads = hidden, layers, heads
        self.segment_len, self.mem_len = segment_len, mem_len
        self.dropout, self.detach_mem = dropout, detach_mem
        self.blocks: Modules[TransformerXLLayer] = Modules(TransformerXLLayer(hidden, heads, dropout)
                                                           for _ in range(layers))
        self.out_norm = nn.LayerNorm(hidden)

    @staticmethod
    def problems(hidden: int, layers: int, heads: int, segment_len: int, mem_len: int) -> list[str]:
        """What is wrong with these settings (empty when they fit)."""
        problems = [] if layers >= 1 else [f"Transformer-XL layers must be at least 1, got {layers}"]
        problems += head_count_problems("Transformer-XL", hidden, heads)
        if hidden % 2:
            problems.append(f"hidden size {hidden} must be even for sinusoidal relative positions")
        if segment_len < 1:
            problems.append(f"segment_len must be at least 1, got {segment_len}")
        if mem_len < 0:
            problems.append(f"mem_len must be at least 0, got {mem_len}")
        return problems

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
