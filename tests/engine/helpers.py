"""Oracles and small fixtures for the DPOptimizer / PrivacyEngine tests."""

import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def small_model(seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)


def small_data(n: int = 12, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=dtype)
    y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def small_loader(n: int = 24, batch_size: int = 6, seed: int = 1, dtype=torch.float64) -> DataLoader:
    x, y = small_data(n, seed, dtype)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def per_sample_grads_oracle(model: nn.Module, x, y):
    """Per-sample gradients by autograd on batches of size 1: list (per param) of (B, *shape)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, params))
    return [torch.stack([r[j] for r in rows]) for j in range(len(params))]


def clipped_sum_oracle(grads, bounds, per_layer: bool):
    """Σ_i f_i g_i by hand: flat f_i = min(1, C/(‖g_i‖+1e-6)), per-layer per tensor."""
    out = []
    if per_layer:
        for g, c in zip(grads, bounds):
            norms = g.reshape(len(g), -1).norm(dim=1)
            f = torch.clamp(c / (norms + 1e-6), max=1.0)
            out.append((f.view(-1, *[1] * (g.dim() - 1)) * g).sum(0))
        return out
    total = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads))
    f = torch.clamp(bounds / (total + 1e-6), max=1.0)
    return [(f.view(-1, *[1] * (g.dim() - 1)) * g).sum(0) for g in grads]


def median_clipped_mean(rows, batch: int):
    """``(bound, update)``: the per-sample norms' median as the bound (about half the samples
    clipped) and the flat-clipped mean ``1/B Σ_i f_i g_i`` of each tensor's rows."""
    bound = torch.sqrt(sum(g.reshape(batch, -1).pow(2).sum(1) for g in rows)).median().item()
    return bound, [s / batch for s in clipped_sum_oracle(rows, bound, False)]


def train_plain(model, batches, make_optimizer, reduction="mean"):
    """Non-private reference training: one optimizer step per batch."""
    opt = make_optimizer(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sample_std(t: torch.Tensor) -> float:
    return float(t.double().std())


def std_tolerance(n: int) -> float:
    """Relative 5-sigma tolerance of a sample std over n Gaussian draws (≈ 5/√(2n))."""
    return 5.0 / math.sqrt(2 * n)


def restore_classic(engine, optimizer, state: dict, load_before_attach: bool) -> None:
    """Attach the classic ``engine`` to ``optimizer`` and load ``state`` (its ``state_dict()``),
    in either order."""
    if load_before_attach:
        engine.load_state_dict(state)
        engine.attach(optimizer)
    else:
        engine.attach(optimizer)
        engine.load_state_dict(state)
