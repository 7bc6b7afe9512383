"""Small models, data and engines shared by the privacy review tests."""

import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def tiny_dataset(n: int = 40, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g, dtype=torch.float64),
                         torch.randint(0, 2, (n,), generator=g))


def quiet(factory, *args, **kwargs):
    """Call ``factory`` with warnings (secure-mode reminder, sampling notes) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(*args, **kwargs)


def modern_engine(**kwargs) -> PrivacyEngine:
    return quiet(PrivacyEngine, **kwargs)


def make_private(model, *, n=40, batch_size=10, lr=0.1, engine_kwargs=None, **kwargs):
    """``(engine, gsm, optimizer, loader)`` of the modern API over :func:`tiny_dataset`."""
    engine = modern_engine(**(engine_kwargs or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(tiny_dataset(n), batch_size=batch_size)
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    gsm, dp_optimizer, loader = quiet(engine.make_private, module=model, optimizer=optimizer,
                                      data_loader=loader, **kwargs)
    return engine, gsm, dp_optimizer, loader


def train(gsm, optimizer, loader, steps: int) -> None:
    """``steps`` private steps over ``loader`` (cycled), one batch each."""
    done = 0
    while done < steps:
        for x, y in loader:
            loss_of(gsm, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def loss_of(model, x, y, reduction="mean"):
    return nn.functional.cross_entropy(model(x), y, reduction=reduction)


def per_sample_grads(model, x, y):
    """Oracle: per-sample gradients by autograd on batches of one (list over trainable params)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss_of(model, x[i:i + 1], y[i:i + 1], "sum"), params)
            for i in range(len(x))]
    return [torch.stack([r[j] for r in rows]) for j in range(len(params))]


def flat_clipped_sum(grads, bound: float):
    """Oracle: Σ_i min(1, C/(‖g_i‖+1e-6)) g_i with the norm over all tensors of sample i."""
    norms = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads))
    factors = torch.clamp(bound / (norms + 1e-6), max=1.0)
    return [torch.einsum("i,i...->...", factors, g) for g in grads]
