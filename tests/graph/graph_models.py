"""Small models with hand-computable graphs for the capture tests (each returns a scalar mean loss).
Shapes are chosen so that every FLOP count and batch dimension can be worked out by hand."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear(8->16) - ReLU - Linear(16->2), squared error against a target."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


def mlp_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 2, generator=g)


class ConvNet(nn.Module):
    """Conv2d(3->4, 3x3, pad 1, no bias) on 6x6 images, then the mean of the feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean()


class DepthwiseNet(nn.Module):
    """Conv2d(1->4, 3x3) then a depthwise Conv2d(4->4, 3x3, groups=4), both padding 1, no bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1, bias=False)
        self.dw = nn.Conv2d(4, 4, kernel_size=3, padding=1, groups=4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dw(self.conv(x)).mean()


class MatmulNet(nn.Module):
    """x (B, S, 8) @ W (8, 5), then the mean."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w).mean()


class FoldNet(nn.Module):
    """(B, S, H) -> transpose to (S, B, H) -> Linear -> back -> reshape (B*S, H) -> Linear -> CE loss."""

    def __init__(self, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.proj(x.transpose(0, 1))           # (S, B, H): batch dim 1
        y = y.transpose(0, 1).reshape(b * s, h)    # (B*S, H): batch folded into dim 0
        return F.cross_entropy(self.head(y), labels.reshape(b * s))


class BNNet(nn.Module):
    """Conv - BatchNorm - ReLU - mean: has buffers that the step updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))).pow(2).mean()


class TinyEncoder(nn.Module):
    """Embedding + one self-attention block (SDPA) + LM head: attention, layer norm, cross entropy."""

    def __init__(self, vocab: int = 11, hidden: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = self.norm(x + self.out(a))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class NonScalar(nn.Module):
    """Returns the per-sample loss (B,) instead of its mean: breaks the model contract."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).squeeze(-1)


class FixedBatch(nn.Module):
    """Reshapes with a literal batch size of 4: cannot run at another per-device batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(4, 6)).mean()


class TupleLoss(MLP):
    """The MLP returning ``(loss, prediction)``: the loss comes first."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.fc2(torch.relu(self.fc1(x)))
        return ((pred - y) ** 2).mean(), pred


class DictLoss(MLP):
    """The MLP returning ``{"prediction": ..., "loss": ...}``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.fc2(torch.relu(self.fc1(x)))
        return {"prediction": pred, "loss": ((pred - y) ** 2).mean()}


class Output:
    """An output object in the Hugging Face convention (``.loss``, ``.logits``), not a mapping."""

    def __init__(self, loss: torch.Tensor, logits: torch.Tensor) -> None:
        self.loss, self.logits = loss, logits


class AttributeLoss(MLP):
    """The MLP returning an ``Output`` with ``.loss``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Output:
        pred = self.fc2(torch.relu(self.fc1(x)))
        return Output(((pred - y) ** 2).mean(), pred)


class DictNoLoss(MLP):
    """Returns ``{"prediction": ...}``: no loss in the output."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"prediction": self.fc2(torch.relu(self.fc1(x)))}


class TuplePerSample(MLP):
    """Returns ``(per-sample loss (B,), prediction)``: the first output is not a scalar."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.fc2(torch.relu(self.fc1(x)))
        return ((pred - y) ** 2).mean(dim=1), pred


class BranchOnValues(MLP):
    """Branches in Python on a tensor's value: cannot be captured as one step."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.fc2(torch.relu(self.fc1(x)))
        if pred.sum() > 0:
            pred = pred * 2
        return ((pred - y) ** 2).mean()
