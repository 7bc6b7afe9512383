"""The tiny models and data sets of the pinned runs (deterministic: seeded construction and data).

Each model family comes with its data set and a loss: ``mlp`` (Linear-Tanh-Linear on 6 features),
``conv`` (Conv2d-ReLU-Linear on 1×6×6 images), ``lstm`` (Embedding → DPLSTM → Linear on 4-token
sequences) and ``bert`` (a one-layer ``transformers`` BERT classifier built from a config, no download).
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from opacus_dp.layers import DPLSTM

N_SAMPLES, N_CLASSES = 32, 3
N_FEATURES, IMAGE, VOCAB, SEQ = 6, 6, 12, 4


class ConvNet(nn.Module):
    """Conv2d(1→3, 3×3) → ReLU → flatten → Linear(48 → 3)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, kernel_size=3)
        self.head = nn.Linear(3 * (IMAGE - 2) ** 2, N_CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


class LSTMNet(nn.Module):
    """Embedding(12, 5) → DPLSTM(5, 6) → Linear(6 → 3) on the last time step."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 5)
        self.lstm = DPLSTM(5, 6, batch_first=True)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, tokens):
        out, _ = self.lstm(self.embedding(tokens))
        return self.head(out[:, -1])


class BertLogits(nn.Module):
    """A one-layer BERT classifier (hidden 8, 2 heads) returning plain logits."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=16, max_position_embeddings=SEQ, num_labels=N_CLASSES,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertForSequenceClassification(config)

    def forward(self, tokens):
        return self.bert(input_ids=tokens).logits


def make_model(family: str) -> nn.Module:
    """The model ``family`` with the same initial parameters on every call and every rank."""
    torch.manual_seed(0)
    if family == "mlp":
        return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, N_CLASSES))
    if family == "conv":
        return ConvNet()
    if family == "lstm":
        return LSTMNet()
    if family == "bert":
        return BertLogits()
    raise ValueError(f"model family must be one of mlp, conv, lstm, bert; got {family!r}")


def dataset(family: str) -> TensorDataset:
    """``N_SAMPLES`` examples of the input ``family`` expects, with labels in ``range(N_CLASSES)``."""
    g = torch.Generator().manual_seed(1234)
    if family == "mlp":
        x = torch.randn(N_SAMPLES, N_FEATURES, generator=g) * 2
    elif family == "conv":
        x = torch.randn(N_SAMPLES, 1, IMAGE, IMAGE, generator=g)
    else:
        x = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)
    return TensorDataset(x, torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=g))
