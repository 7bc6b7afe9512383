"""The five models of ``scripts/benchmark.py``, each with its batch and loss.

* ``convnet``: the CIFAR-10 convnet of the Opacus tutorial (four 3×3 convolutions with
  average pooling, 32→64→64→128 channels, a linear head), B = 128, 3×32×32;
* ``resnet``: an 8-layer ResNet with GroupNorm (a 3×3 stem and three basic blocks of two
  3×3 convolutions, 16/32/64 channels, 1×1 projections, linear head), B = 128, 3×32×32;
* ``sequence``: token embedding (vocabulary 5000, d = 256) and two pre-LayerNorm MLP blocks
  (256 → 1024 → 256, GELU, residual), mean pooled, 2 classes; B = 32, T = 128;
* ``transformer``: the same embedding and two pre-LayerNorm transformer blocks with
  DPMultiheadAttention (4 heads) and the same MLP; B = 32, T = 128;
* ``lstm``: token embedding (5000 × 64), a one-layer DPLSTM with 128 hidden units, linear
  head on the last state; B = 32, T = 64.

``layers`` selects ``opacus_dp.layers`` or ``opacus.layers`` for the DP attention / LSTM, so
each library runs its own implementation of the same architecture.
"""

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn as nn

VOCAB, CLASSES = 5000, 2


@dataclass
class Workload:
    """A model factory, one fixed batch, and the criterion of the step."""

    name: str
    build: Callable[[object], nn.Module]
    batch: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    description: str


def convnet(layers=None) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(32, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, 10, bias=True),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(8, cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))

    def forward(self, x):
        out = torch.relu(self.gn1(self.conv1(x)))
        return torch.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


def resnet8(layers=None) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(8, 16), nn.ReLU(),
        BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(64, 10),
    )


class MLPBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class AttentionBlock(nn.Module):
    def __init__(self, d: int, heads: int, layers):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = layers.DPMultiheadAttention(d, heads, batch_first=True)
        self.mlp = MLPBlock(d)

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.mlp(x)


class Classifier(nn.Module):
    """Embedding, a body over positions, final LayerNorm, mean pooling, linear head."""

    def __init__(self, body: nn.Module, d: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.body, self.ln, self.head = body, nn.LayerNorm(d), nn.Linear(d, CLASSES)

    def forward(self, tokens):
        return self.head(self.ln(self.body(self.emb(tokens))).mean(dim=1))


def sequence_model(layers=None) -> nn.Module:
    return Classifier(nn.Sequential(MLPBlock(256), MLPBlock(256)), 256)


def transformer(layers) -> nn.Module:
    return Classifier(nn.Sequential(AttentionBlock(256, 4, layers), AttentionBlock(256, 4, layers)), 256)


class LSTMClassifier(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.lstm = layers.DPLSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, CLASSES)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


def lstm(layers) -> nn.Module:
    return LSTMClassifier(layers)


def _images(batch: int):
    return lambda: (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))


def _tokens(batch: int, length: int):
    return lambda: (torch.randint(0, VOCAB, (batch, length)), torch.randint(0, CLASSES, (batch,)))


WORKLOADS = {
    "convnet": Workload("convnet", convnet, _images(128), "Opacus CIFAR-10 convnet, B=128, 3x32x32"),
    "resnet": Workload("resnet", resnet8, _images(128), "ResNet-8 with GroupNorm, B=128, 3x32x32"),
    "sequence": Workload("sequence", sequence_model, _tokens(32, 128),
                         "embedding + 2 LayerNorm/MLP blocks, d=256, T=128, B=32"),
    "transformer": Workload("transformer", transformer, _tokens(32, 128),
                            "embedding + 2 DPMultiheadAttention blocks, d=256, h=4, T=128, B=32"),
    "lstm": Workload("lstm", lstm, _tokens(32, 64), "embedding + DPLSTM(64->128), T=64, B=32"),
}
