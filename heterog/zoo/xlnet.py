"""XLNet (Yang et al. 2019) permutation-LM pre-training: two-stream (content + query) relative
self-attention with Transformer-XL positional encoding and relative segment encoding; Large by default."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import InputFactory, Inputs, check_positive, dropout
from heterog.zoo.layers import FeedForward, check_heads, init_normal, masked_scores, sinusoid

LN_EPS = 1e-12


def rel_shift(scores: torch.Tensor, klen: int) -> torch.Tensor:
    """Align position scores against relative distances to key positions (Transformer-XL).

    Shapes: `(B, H, T, R)` scores of each query against the R = 2T relative distances
    T, T-1, .., -T+1 -> `(B, H, T, klen)` scores of each query against each key.
    """
    b, h, t, r = scores.shape
    shifted = scores.reshape(b, h, r, t)[:, :, 1:, :]
    return shifted.reshape(b, h, t, r - 1)[..., :klen]


class TwoStreamRelativeAttention(nn.Module):
    """XLNet's relative multi-head attention, applied with shared weights to the content stream h
    and the query stream g; score = content (ac) + position (bd) + segment (ef) terms.

    Shapes:
        h `(B, T, D)`, g `(B, P, D)`, pos `(2T, D)`, other_segment `(B, T, T)` bool,
        blocked_h / blocked_g `(B, T, T)` bool, target_mapping `(B, P, T)` -> (h, g) with the same shapes.
    """

    def __init__(self, hidden: int, heads: int, eps: float, dropout_p: float) -> None:
        super().__init__()
        head_dim = check_heads(hidden, heads)
        self.heads = heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.r = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(heads, head_dim))
        self.r_r_bias = nn.Parameter(torch.zeros(heads, head_dim))
        self.r_s_bias = nn.Parameter(torch.zeros(heads, head_dim))
        self.seg_embed = nn.Parameter(torch.zeros(2, heads, head_dim))
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.drop = dropout(dropout_p)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kr: torch.Tensor,
               other_segment: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """q, k, v `(B, H, T, d)`, kr `(H, 2T, d)` -> `(B, H, T, d)`."""
        ac = (q + self.r_w_bias[:, None]) @ k.transpose(-2, -1)
        bd = rel_shift((q + self.r_r_bias[:, None]) @ kr.transpose(-2, -1), k.shape[-2])
        seg = (q + self.r_s_bias[:, None]) @ self.seg_embed.permute(1, 2, 0)  # (B, H, T, 2): same / other
        ef = torch.where(other_segment[:, None], seg[..., 1:2], seg[..., 0:1])
        scores = masked_scores((ac + bd + ef) * self.scale, blocked[:, None])
        return self.drop(scores.softmax(dim=-1)) @ v

    def post(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self.norm(residual + self.drop(self.o(attended.transpose(-3, -2).flatten(-2))))

    def forward(self, h: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, other_segment: torch.Tensor,
                blocked_h: torch.Tensor, blocked_g: torch.Tensor, target_mapping: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, kr = self.split(self.k(h)), self.split(self.v(h)), self.split(self.r(pos))
        new_h = self.post(h, self.attend(self.split(self.q(h)), k, v, kr, other_segment, blocked_h))
        mapping = target_mapping[:, None]  # (B, 1, P, T)
        q_g = mapping.transpose(-2, -1) @ self.split(self.q(g))  # queries placed at their target positions
        new_g = self.post(g, mapping @ self.attend(q_g, k, v, kr, other_segment, blocked_g))
        return new_h, new_g


class XLNetLayer(nn.Module):
    """Two-stream relative attention followed by a post-LN GELU feed-forward on each stream."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout_p: float) -> None:
        super().__init__()
        self.attn = TwoStreamRelativeAttention(hidden, heads, LN_EPS, dropout_p)
        self.ffn = FeedForward(hidden, ffn, "gelu", dropout_p)
        self.norm = nn.LayerNorm(hidden, eps=LN_EPS)
        self.drop = dropout(dropout_p)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(self.ffn(x)))

    def forward(self, h: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, other_segment: torch.Tensor,
                blocked_h: torch.Tensor, blocked_g: torch.Tensor, target_mapping: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, g = self.attn(h, g, pos, other_segment, blocked_h, blocked_g, target_mapping)
        return self.feed_forward(h), self.feed_forward(g)


class XLNetLM(nn.Module):
    """XLNet with the LM head (weight tied to the word embedding, own bias) on the query stream.

    The permutation is an input: perm_mask[b, i, j] = 1 means position i may not see j; the
    query stream is blocked exactly there, the content stream additionally sees itself.

    Shapes:
        input_ids `(B, T)`, token_type_ids `(B, T)`, perm_mask `(B, T, T)` float,
        target_mapping `(B, P, T)` float one-hot, labels `(B, P)` -> scalar mean loss.
    """

    def __init__(
        self, *, vocab: int, layers: int, hidden: int, heads: int, ffn: int, dropout_p: float
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.word = nn.Embedding(vocab, hidden)
        self.mask_emb = nn.Parameter(torch.zeros(1, 1, hidden))
        self.layers = nn.ModuleList(XLNetLayer(hidden, heads, ffn, dropout_p) for _ in range(layers))
        self.lm_bias = nn.Parameter(torch.zeros(vocab))
        self.drop = dropout(dropout_p)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_normal(self, 0.02)
        for layer in self.layers:
            assert isinstance(layer, XLNetLayer)
            attn = layer.attn
            for param in (attn.r_w_bias, attn.r_r_bias, attn.r_s_bias, attn.seg_embed):
                nn.init.normal_(param, std=0.02)
        nn.init.normal_(self.mask_emb, std=0.02)
        nn.init.zeros_(self.lm_bias)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, perm_mask: torch.Tensor,
                target_mapping: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        blocked_g = perm_mask > 0.5
        blocked_h = blocked_g & ~torch.eye(length, dtype=torch.bool, device=input_ids.device)
        other_segment = token_type_ids[:, :, None] != token_type_ids[:, None, :]
        distances = length - torch.arange(2 * length, device=input_ids.device, dtype=torch.float32)
        pos = self.drop(sinusoid(distances, self.hidden, interleave=False).to(self.word.weight.dtype))
        h = self.drop(self.word(input_ids))
        g = self.drop(self.mask_emb.expand(target_mapping.shape[0], target_mapping.shape[1], -1))
        for layer in self.layers:
            h, g = layer(h, g, pos, other_segment, blocked_h, blocked_g, target_mapping)
        logits = g @ self.word.weight.t() + self.lm_bias
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def permutation_inputs(factory: InputFactory, input_ids: torch.Tensor, predictions: int) -> Inputs:
    """perm_mask, target_mapping and labels of one random factorisation order per sequence;
    the last `predictions` positions of the order are the targets (XLNet's partial prediction)."""
    batch, length = input_ids.shape
    order = factory.uniform(batch, length).argsort(dim=1)  # order[:, k] = position predicted k-th
    rank = order.argsort(dim=1)  # rank[:, i] = step at which position i comes
    perm_mask = (rank[:, None, :] >= rank[:, :, None]).float()  # i may see j only if j comes earlier
    targets = order[:, length - predictions:]
    target_mapping = (targets[:, :, None] == torch.arange(length, device=input_ids.device)).float()
    labels = torch.gather(input_ids, 1, targets)
    return perm_mask, target_mapping, labels


def build_xlnet_large(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    ffn: int | None = None,
    vocab: int = 32000,
    seq_len: int = 128,
    predictions: int | None = None,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    ffn = 4 * hidden if ffn is None else ffn
    predictions = max(1, seq_len // 6) if predictions is None else predictions  # XLNet: K = 6 (85 of 512)
    check_positive("xlnet_large", layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab,
                   seq_len=seq_len, predictions=predictions)
    if predictions > seq_len:
        raise HeterogError(f"zoo model 'xlnet_large': predictions {predictions} exceeds seq_len {seq_len}")
    if hidden % 2:
        raise HeterogError(f"zoo model 'xlnet_large': hidden {hidden} must be even (sinusoidal positions)")
    model = XLNetLM(vocab=vocab, layers=layers, hidden=hidden, heads=heads, ffn=ffn, dropout_p=dropout)
    input_ids = factory.integers(vocab, batch_size, seq_len)
    segment_b = torch.arange(seq_len, device=factory.device) >= seq_len // 2
    token_type_ids = segment_b.long().expand(batch_size, seq_len).contiguous()
    perm_mask, target_mapping, labels = permutation_inputs(factory, input_ids, predictions)
    return model, (input_ids, token_type_ids, perm_mask, target_mapping, labels)
