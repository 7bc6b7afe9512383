"""Small models and user-labelled datasets for the privacy-unit tests."""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

N_EXAMPLES, N_USERS, CLASSES = 36, 9, 3


class SequenceClassifier(nn.Module):
    """Embedding → LayerNorm → Linear over positions → mean over positions."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, tokens):
        return self.head(self.norm(self.embedding(tokens))).mean(dim=1)


class WideSequence(nn.Module):
    """Embedding → Linear → Tanh → Linear over positions, mean over positions (Linear layers wide
    enough for the ghost norm over positions)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 24)
        self.hidden = nn.Linear(24, 24)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embedding(tokens)))).mean(dim=1)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, CLASSES))
    if kind == "conv":
        return nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(27, CLASSES))
    if kind == "sequence":
        return SequenceClassifier()
    if kind == "wide_sequence":
        return WideSequence()
    raise ValueError(kind)


def make_data(kind: str, seed: int = 1):
    """``(dataset, user_ids)``: users own 1 to 7 examples (uneven), ids not in example order."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("sequence", "wide_sequence"):
        x = torch.randint(0, 11, (N_EXAMPLES, 4 if kind == "wide_sequence" else 5), generator=g)
    elif kind == "conv":
        x = torch.randn(N_EXAMPLES, 2, 5, 5, generator=g)
    else:
        x = torch.randn(N_EXAMPLES, 6, generator=g) * 3
    y = torch.randint(0, CLASSES, (N_EXAMPLES,), generator=g)
    sizes = [1, 2, 3, 7, 5, 4, 6, 2, 6]  # 36 examples over 9 users
    users = torch.repeat_interleave(torch.tensor([40, 3, 17, 8, 25, 11, 5, 30, 2]), torch.tensor(sizes))
    users = users[torch.randperm(N_EXAMPLES, generator=g)]
    return TensorDataset(x, y), users


def stepped_batches(model: nn.Module, optimizer, loader, record):
    """``[record(x) for every batch]`` of the private ``loader``, each batch followed by its private
    step (the loader refuses a batch whose predecessor got none)."""
    records = []
    for x, y in loader:
        records.append(record(x))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return records
