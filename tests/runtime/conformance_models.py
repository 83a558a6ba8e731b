"""Conformance models: small models written from the torch.nn blocks users reach for.

Each ``build_*(batch_size)`` returns ``(module, example_inputs)``: ``module(*inputs)`` is the scalar mean
loss, every input has the batch on dim 0, weights are random (seeded) and sizes tiny, so one run of a few
steps on local-cpu-2/3 takes about a second.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, C, H = 32, 8, 16, 2


def _tokens(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch_size, T), generator=g)
    y = torch.randint(0, VOCAB, (batch_size, T), generator=g)
    return x, y


class TiedDecoder(nn.Module):
    """Decoder-only LM: nn.TransformerEncoderLayer (norm_first) with a causal src_mask, output tied to the
    token embedding."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.pos = nn.Parameter(torch.randn(T, C) * 0.1)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos
        for layer in self.layers:
            h = layer(h, src_mask=self.mask)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build_tied_decoder(batch_size: int = 6):
    torch.manual_seed(0)
    return TiedDecoder(), _tokens(batch_size)


class WideEmbeddings(nn.Module):
    """Eight embedding tables (recommender-style small uniform init) whose lookups are concatenated and fed
    to an MLP with a binary cross-entropy loss (its backward divides by the batch in place)."""

    def __init__(self, tables: int = 8, rows: int = 2000, dim: int = 4) -> None:
        super().__init__()
        self.rows = rows
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
        for t in self.tables:
            nn.init.uniform_(t.weight, -rows ** -0.5, rows ** -0.5)
        self.mlp = nn.Sequential(nn.Linear(tables * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([t(idx[:, i]) for i, t in enumerate(self.tables)], dim=1)
        return F.binary_cross_entropy_with_logits(self.mlp(h).squeeze(1), y)


def build_wide_embeddings(batch_size: int = 6):
    torch.manual_seed(0)
    m = WideEmbeddings()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, m.rows, (batch_size, 8), generator=g)
    return m, (idx, torch.randint(0, 2, (batch_size,), generator=g).float())


class SdpaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, C_ = x.shape
        q, k, v = self.qkv(x).view(B, T_, 3, H, C_ // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(B, T_, C_))


class SdpaClassifier(nn.Module):
    """Two causal self-attention layers through F.scaled_dot_product_attention and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, C)
        self.blocks = nn.ModuleList(SdpaBlock() for _ in range(2))
        self.cls = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.cls(h.mean(1)), y)


def build_sdpa_classifier(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return SdpaClassifier(), (torch.randn(batch_size, T, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g))
