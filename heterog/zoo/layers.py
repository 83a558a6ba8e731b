"""Transformer building blocks shared by the zoo's sequence models: explicit (matmul-softmax)
multi-head attention, feed-forward, a pre-/post-LN layer, masks and sinusoidal positions."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import dropout

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as in BERT and XLNet
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
}


def check_heads(hidden: int, heads: int) -> int:
    """Head size; rejects a hidden size that the heads do not divide."""
    if heads <= 0 or hidden % heads:
        raise HeterogError(f"hidden size {hidden} is not divisible by {heads} heads")
    return hidden // heads


def masked_scores(scores: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """Fill blocked positions with the dtype's lowest value (a fully blocked row stays finite)."""
    if blocked is None:
        return scores
    return scores.masked_fill(blocked, torch.finfo(scores.dtype).min)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """`(T, T)` bool, True above the diagonal: position i may not attend to j > i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


def sinusoid(positions: torch.Tensor, dim: int, *, interleave: bool) -> torch.Tensor:
    """Sinusoidal encodings `(len(positions), dim)` of float positions.

    interleave=True gives Vaswani et al.'s layout (sin on even, cos on odd features);
    False gives XLNet/Transformer-XL's [sin | cos] halves.
    """
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=positions.dtype) / dim
    inv_freq = 1.0 / (10000.0**exponents)
    angles = positions[:, None] * inv_freq[None, :]
    if interleave:
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class MultiHeadAttention(nn.Module):
    """Multi-head attention written out as matmul -> masked softmax -> matmul.

    Args:
        hidden: model width D; heads: number of heads (must divide D).
        bias: whether the q/k/v/out projections have biases.
        dropout_p: dropout on the attention probabilities.

    Shapes:
        x `(B, T, D)`, memory `(B, S, D)` (defaults to x), blocked bool broadcastable to
        `(B, heads, T, S)` (True = may not attend) -> `(B, T, D)`.
    """

    def __init__(self, hidden: int, heads: int, *, bias: bool = True, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(check_heads(hidden, heads))
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, hidden, bias=bias)
        self.v = nn.Linear(hidden, hidden, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)
        self.drop = dropout(dropout_p)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, blocked: torch.Tensor | None = None
    ) -> torch.Tensor:
        source = x if memory is None else memory
        q, k, v = self.split(self.q(x)), self.split(self.k(source)), self.split(self.v(source))
        scores = masked_scores(q @ k.transpose(-2, -1) * self.scale, blocked)
        probs = self.drop(scores.softmax(dim=-1))
        return self.out((probs @ v).transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return f"heads={self.heads}"


class FeedForward(nn.Module):
    """Position-wise Linear(D, F) -> activation -> Linear(F, D). Shapes: `(..., D)` -> `(..., D)`."""

    def __init__(self, hidden: int, ffn: int, activation: str, dropout_p: float = 0.0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise HeterogError(f"unknown activation '{activation}'; known: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.drop = dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(ACTIVATIONS[self.activation](self.fc1(x))))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class TransformerLayer(nn.Module):
    """Self-attention, optional cross-attention over a memory, and a feed-forward block,
    each wrapped in a residual connection with LayerNorm after (post-LN: Vaswani, BERT)
    or before (pre-LN: GPT-2) the sub-block.

    Shapes:
        x `(B, T, D)`, self_blocked broadcastable to `(B, heads, T, T)`,
        memory `(B, S, D)` (only with cross_attention) -> `(B, T, D)`.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        *,
        activation: str = "relu",
        norm_first: bool = False,
        cross_attention: bool = False,
        eps: float = 1e-5,
        dropout_p: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(hidden, heads, dropout_p=dropout_p)
        self.norm_self = nn.LayerNorm(hidden, eps=eps)
        self.cross_attn = MultiHeadAttention(hidden, heads, dropout_p=dropout_p) if cross_attention else None
        self.norm_cross = nn.LayerNorm(hidden, eps=eps) if cross_attention else None
        self.ffn = FeedForward(hidden, ffn, activation, dropout_p)
        self.norm_ffn = nn.LayerNorm(hidden, eps=eps)
        self.drop = dropout(dropout_p)

    def residual(self, x: torch.Tensor, norm: nn.Module, block: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
        if self.norm_first:
            return x + self.drop(block(norm(x)))
        return norm(x + self.drop(block(x)))

    def forward(
        self,
        x: torch.Tensor,
        self_blocked: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.residual(x, self.norm_self, lambda h: self.self_attn(h, blocked=self_blocked))
        cross_attn, norm_cross = self.cross_attn, self.norm_cross
        if cross_attn is not None and norm_cross is not None:      # both or neither
            x = self.residual(x, norm_cross, lambda h: cross_attn(h, memory=memory))
        return self.residual(x, self.norm_ffn, self.ffn)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"


def init_normal(module: nn.Module, std: float) -> None:
    """BERT/GPT-2 style init: Linear and Embedding weights ~ N(0, std), biases 0, LayerNorm (1, 0)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            bias = getattr(m, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over every token: logits `(B, T, V)`, labels `(B, T)` -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=label_smoothing)
