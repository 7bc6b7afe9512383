"""Small models, per-sample autograd oracles and ``make_private`` set-ups for the precision tests."""

import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp

MODES = ("hooks", "functorch", "ghost", "bk")
N_PARAMS = 4  # the tensors of mlp()


def mlp(seed: int = 0, dtype=torch.float32, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(dtype)


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``Σ (out − y)²`` in the target's dtype (float32 for autocast's half-precision outputs; a
    ``sum`` loss, so the per-sample gradients are the summed ones)."""
    return ((out.to(target.dtype) - target) ** 2).sum()


def bounds(clipping: str, c: float):
    """``C`` (flat), or ``C/√n`` for each of the ``n`` tensors (the same sensitivity)."""
    return c if clipping == "flat" else [c / N_PARAMS ** 0.5] * N_PARAMS


def private(model, x, y, *, mode="hooks", clipping="flat", c=1.0, sigma=0.0, seed=None, batch_size=None):
    """``(engine, module, optimizer, criterion)`` of ``make_private`` with a ``sum`` loss, fixed-size
    batches of ``batch_size`` (default ``len(x)``), lr 0, noise from a generator seeded ``seed``."""
    engine = opacus_dp.PrivacyEngine(accountant="rdp")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    criterion = nn.MSELoss(reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size or len(x)),
            noise_multiplier=sigma, max_grad_norm=bounds(clipping, c), clipping=clipping,
            grad_sample_mode=mode, poisson_sampling=False, loss_reduction="sum",
            noise_generator=generator, **({"criterion": criterion} if mode == "ghost" else {}))
    return engine, out[0], out[1], (out[2] if len(out) == 4 else None)


def per_sample_grads(model: nn.Module, x, y, loss=squared_error):
    """Per-sample gradients by autograd on batches of one sample: one ``(B, *shape)`` per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(len(x))]
    return [torch.stack([r[j] for r in rows]) for j in range(len(params))]


def clipped_sum(grads, clipping: str, c: float):
    """``Σ_i f_i g_i`` in float64: flat ``f_i = min(1, C/(‖g_i‖ + 1e-6))``, per layer per tensor;
    a NaN/inf norm drops the sample (flat) or its part of that tensor (per layer)."""
    grads = [g.double() for g in grads]
    norms = [g.reshape(len(g), -1).norm(dim=1) for g in grads]
    if clipping == "flat":
        norms = [torch.sqrt(sum(n.pow(2) for n in norms))] * len(grads)
    out = []
    for g, n, bound in zip(grads, norms, [c] * len(grads) if clipping == "flat" else bounds(clipping, c)):
        keep = torch.isfinite(n)
        f = torch.where(keep, torch.clamp(bound / (n + 1e-6), max=1.0), 0.0)
        rows = torch.where(keep.view(-1, *[1] * (g.dim() - 1)), g, 0.0)
        out.append((f.view(-1, *[1] * (g.dim() - 1)) * rows).sum(0))
    return out


def relative_error(got, want) -> float:
    """The largest ``|got − want|`` over every tensor, relative to that tensor's largest ``|want|``."""
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
               for a, b in zip(got, want))
