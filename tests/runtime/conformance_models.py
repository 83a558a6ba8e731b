"""Conformance models: small models written from the torch.nn blocks users reach for.

Each ``build_*(batch_size)`` returns ``(module, example_inputs)``: ``module(*inputs)`` (or
``module(**inputs)`` for keyword inputs) is the scalar mean loss, every positional input has the batch on
dim 0, weights are random (seeded) and sizes tiny, so one run of a few steps on local-cpu-2/3 takes about
a second.
"""
from __future__ import annotations

import os

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


def _sequence_classifier(cls: type[nn.Module], batch_size: int):
    """``cls()`` with seeded weights and inputs: sequences (B, T, 4) and labels of 3 classes."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, T, 4, generator=g)
    return cls(), (x, torch.randint(0, 3, (batch_size,), generator=g))


def build_sdpa_classifier(batch_size: int = 6):
    return _sequence_classifier(SdpaClassifier, batch_size)


class MhaClassifier(nn.Module):
    """nn.MultiheadAttention (sequence-first, so the batch moves inward) with a causal attn_mask and a
    key_padding_mask input, mean-pooled into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, C)
        self.attn = nn.MultiheadAttention(C, H)
        self.norm = nn.LayerNorm(C)
        self.cls = nn.Linear(C, 3)
        self.register_buffer("causal", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(0, 1)                          # (T, B, C)
        a, _ = self.attn(h, h, h, attn_mask=self.causal, key_padding_mask=pad)
        h = self.norm(h + a).transpose(0, 1)
        return F.cross_entropy(self.cls(h.mean(1)), y)


def build_mha_classifier(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    pad = torch.rand(batch_size, T, generator=g) < 0.3
    pad[:, 0] = False                                            # every query sees at least one key
    return MhaClassifier(), (torch.randn(batch_size, T, 4, generator=g), pad,
                             torch.randint(0, 3, (batch_size,), generator=g))


class Seq2Seq(nn.Module):
    """nn.TransformerEncoderLayer (post-norm) with a source key-padding mask feeding an
    nn.TransformerDecoderLayer with a causal tgt_mask and a memory key-padding mask; token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, C)
        self.tgt_emb = nn.Embedding(VOCAB, C)
        self.enc = nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True)
        self.out = nn.Linear(C, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, src: torch.Tensor, src_pad: torch.Tensor, tgt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mem = self.enc(self.src_emb(src), src_key_padding_mask=src_pad)
        h = self.dec(self.tgt_emb(tgt), mem, tgt_mask=self.mask, memory_key_padding_mask=src_pad)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def build_seq2seq(batch_size: int = 6):
    torch.manual_seed(0)
    src, tgt = _tokens(batch_size, 1)
    _, y = _tokens(batch_size, 2)
    pad = torch.zeros(batch_size, T, dtype=torch.bool)
    pad[::2, -2:] = True
    return Seq2Seq(), (src, pad, tgt, y)


class BagModel(nn.Module):
    """nn.EmbeddingBag: a weighted sum bag and a mean bag over fixed-length bags, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.sum_bag = nn.EmbeddingBag(4 * VOCAB, 8, mode="sum")
        self.mean_bag = nn.EmbeddingBag(VOCAB, 8, mode="mean")
        self.cls = nn.Linear(16, 3)

    def forward(self, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.sum_bag(a, per_sample_weights=w), self.mean_bag(b)], dim=1)
        return F.cross_entropy(self.cls(torch.tanh(h)), y)


def build_embedding_bag(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return BagModel(), (torch.randint(0, 4 * VOCAB, (batch_size, 5), generator=g),
                        torch.rand(batch_size, 5, generator=g), torch.randint(0, VOCAB, (batch_size, 3), generator=g),
                        torch.randint(0, 3, (batch_size,), generator=g))


class LstmTagger(nn.Module):
    """Embedding -> two-layer nn.LSTM (batch first) -> per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.lstm = nn.LSTM(C, C, num_layers=2, batch_first=True)
        self.out = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        return F.cross_entropy(self.out(h).reshape(-1, 5), (y % 5).reshape(-1))


def build_lstm_tagger(batch_size: int = 6):
    torch.manual_seed(0)
    return LstmTagger(), _tokens(batch_size)


class GruClassifier(nn.Module):
    """Bidirectional nn.GRU over the sequence-first layout; the final hidden states of both directions
    are concatenated into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, C, bidirectional=True)
        self.cls = nn.Linear(2 * C, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(x.transpose(0, 1))                       # h: (2, B, C)
        return F.cross_entropy(self.cls(torch.cat([h[0], h[1]], dim=1)), y)


def build_gru_classifier(batch_size: int = 6):
    return _sequence_classifier(GruClassifier, batch_size)


class GluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.up = nn.Linear(C, 2 * C)
        self.bias = nn.Parameter(torch.randn(1, 1, C) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(self.norm(x)).chunk(2, dim=-1)
        lo, hi = (a * torch.sigmoid(b)).split([C // 4, 3 * C // 4], dim=-1)
        return x + torch.cat([hi, lo], dim=-1) + self.bias.expand(x.shape[0], x.shape[1], C)


class ResidualGlu(nn.Module):
    """Pre-norm residual GLU blocks: LayerNorm, chunk, split, cat, an expanded bias, residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, C)
        self.blocks = nn.Sequential(GluBlock(), GluBlock())
        self.out = nn.Linear(C, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(self.blocks(self.inp(x))).squeeze(-1), y)


def build_residual_glu(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ResidualGlu(), (torch.randn(batch_size, T, 4, generator=g), torch.randn(batch_size, T, generator=g))


class ViewChains(nn.Module):
    """A convolution followed by chains of permute, reshape, transpose, split, cat, view, chunk, unsqueeze
    and expand between small linear maps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mix = nn.Linear(4, 4)
        self.fc = nn.Linear(32, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        h = self.conv(x).permute(0, 2, 3, 1).reshape(B, 16, 4)          # (B, H*W, C)
        h = self.mix(h).transpose(1, 2)                                  # (B, C, H*W), not contiguous
        p, q = h.split([1, 3], dim=1)
        h = torch.cat([q, p], dim=1).contiguous().view(B, 2, 32)         # (B, 2, 32)
        a, b = h.chunk(2, dim=1)
        z = self.fc((a * torch.tanh(b)).squeeze(1))                      # (B, 8)
        z = z.unsqueeze(1).expand(B, 3, 8).reshape(B, 24)[:, ::3]        # strided slice back to (B, 8)
        return F.mse_loss(self.out(torch.relu(z)).squeeze(1), y)


def build_view_chains(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ViewChains(), (torch.randn(batch_size, 3, 4, 4, generator=g), torch.randn(batch_size, generator=g))


class BatchNormCnn(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> pooled classifier: batch statistics are per replica (documented), so
    data-parallel plans equal per-replica (DDP-style) training, not single-process training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.cls = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return F.cross_entropy(self.cls(h.mean((2, 3))), y)


def build_batchnorm_cnn(batch_size: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, 3, 4, 4, generator=g)
    return BatchNormCnn(), (x, torch.randint(0, 3, (batch_size,), generator=g))


class MadeInside(nn.Module):
    """Tensors made inside the model from the input's batch size, as transformers libraries make them: a
    buffer of token-type ids expanded to the batch (BERT), ``new_ones`` / ``zeros`` / ``full`` / ``arange``
    factories, a causal mask built from the input's shape (GPT-2), labels shifted right by writing into a
    slice of ``new_zeros`` and reading it whole (T5), and ``arange(B)`` as row indices."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.types = nn.Embedding(2, C)
        self.dec_emb = nn.Embedding(VOCAB, C)
        self.head = nn.Linear(C, VOCAB)
        self.register_buffer("type_ids", torch.zeros(1, T, dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        h = self.emb(x) + self.types(self.type_ids.expand(B, T))
        causal = torch.ones(B, T, T, dtype=torch.bool).tril()
        scores = (h @ h.transpose(1, 2)).masked_fill(~causal, float("-inf")) / C ** 0.5
        h = h + torch.full((B, 1, 1), 0.5) * (scores.softmax(-1) @ h) + x.new_ones(B, T, 1) * 0.1
        h = h + torch.zeros(B, T, C) + torch.arange(T).expand(B, T).unsqueeze(-1) * 0.01
        shifted = y.new_zeros(y.shape)
        shifted[:, 1:] = y[:, :-1].clone()
        shifted[:, 0] = 0
        h = h + self.dec_emb(shifted)
        last = h[torch.arange(B), -1]
        loss = F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))
        return loss + 0.1 * self.head(last).logsumexp(-1).mean()


def build_made_inside(batch_size: int = 6):
    torch.manual_seed(0)
    return MadeInside(), _tokens(batch_size, 3)


class DropoutNet(nn.Module):
    """Random values in training mode: ``nn.Dropout`` after an embedding and inside an MLP, functional
    dropout on attention weights, and Gaussian noise from ``randn_like``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * C, C))
        self.out = nn.Linear(C, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(x))
        a = F.dropout((h @ h.transpose(1, 2) / C ** 0.5).softmax(-1), 0.1, training=True)
        h = h + a @ h + 0.01 * torch.randn_like(h)
        h = h + self.mlp(h)
        return F.cross_entropy(self.out(h).reshape(-1, VOCAB), y.reshape(-1))


def build_dropout_net(batch_size: int = 6):
    torch.manual_seed(0)
    return DropoutNet(), _tokens(batch_size, 4)


class KeywordTagger(nn.Module):
    """Called with keyword arguments, as model libraries' models are: token ids, a row of position ids
    shared by every sample (no batch dimension), labels, and a constant flag."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, C)
        self.pos = nn.Embedding(T, C)
        self.out = nn.Linear(C, VOCAB)

    def forward(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                return_dict: bool = False):
        h = torch.tanh(self.tok(input_ids) + self.pos(position_ids))
        loss = F.cross_entropy(self.out(h).reshape(-1, VOCAB), labels.reshape(-1))
        return {"loss": loss} if return_dict else loss


def build_keyword_tagger(batch_size: int = 6):
    torch.manual_seed(0)
    x, y = _tokens(batch_size, 5)
    return KeywordTagger(), {"input_ids": x, "position_ids": torch.arange(T)[None], "labels": y,
                             "return_dict": True}


class PaddedTagger(nn.Module):
    """A token tagger whose padded positions carry the label -100 (``ignore_index``), unevenly over the
    samples: the mean loss divides by the count of real labels of the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, C)
        self.out = nn.Linear(C, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(torch.tanh(self.tok(x))).reshape(-1, VOCAB), y.reshape(-1))


def build_padded_tagger(batch_size: int = 6):
    torch.manual_seed(0)
    x, y = _tokens(batch_size, 7)
    lengths = torch.arange(batch_size) % T + 1                 # sample i keeps its first lengths[i] labels
    y = torch.where(torch.arange(T)[None, :] < lengths[:, None], y, torch.full_like(y, -100))
    return PaddedTagger(), (x, y)


# name -> build: the models every plan must train exactly like one process
EQUIVALENCE_MODELS = {
    "tied_decoder": build_tied_decoder,
    "wide_embeddings": build_wide_embeddings,
    "sdpa_classifier": build_sdpa_classifier,
    "mha_classifier": build_mha_classifier,
    "seq2seq": build_seq2seq,
    "embedding_bag": build_embedding_bag,
    "lstm_tagger": build_lstm_tagger,
    "gru_classifier": build_gru_classifier,
    "residual_glu": build_residual_glu,
    "view_chains": build_view_chains,
    "made_inside": build_made_inside,
    "dropout_net": build_dropout_net,
    "keyword_tagger": build_keyword_tagger,
}

# Plans divided beyond the batch (splits, grids) of the recurrent models take minutes per plan on two cores
# (their cells unroll into thousands of ops): `make test` divides the other models, each under half of the
# suites' (cluster, micro-batches) combinations in turn; `make conformance` (HETEROG_DIVIDED_ALL=1) every
# model under every combination. Data-parallel and random plans of the recurrent ones run in both.
DIVIDED_ALL = os.environ.get("HETEROG_DIVIDED_ALL") == "1"
RECURRENT = ("lstm_tagger", "gru_classifier")
DIVIDED_MODELS = [name for name in EQUIVALENCE_MODELS if name not in RECURRENT or DIVIDED_ALL]


def divided_cases(*axes: tuple) -> list[tuple]:
    """(model, *choice) for every model of DIVIDED_MODELS and every choice of one value per axis; in `make
    test` only the half whose model index and choice indices sum to an even number, so each model meets
    each value of an axis at least once and each value meets half the models."""
    import itertools

    out = []
    for i, name in enumerate(DIVIDED_MODELS):
        for idx in itertools.product(*(range(len(a)) for a in axes)):
            if DIVIDED_ALL or (i + sum(idx)) % 2 == 0:
                out.append((name, *(a[k] for a, k in zip(axes, idx))))
    return out
