"""Run on every rank of a spawned gloo job by ``test_fsdp_deferred_checks.py``: one private step
of a sequence model sharded with FSDP2, on a batch whose positions cancel, with the ghost norms'
checks deferred to the step (the default of ``bk`` with flat clipping) and read at once."""

import warnings

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample.bookkeeping import deferred_checks, passes
from opacus_dp.grad_sample.bookkeeping.norm_samplers import trust
from tests.distributed.workers_fsdp import full_params

D, P, T, BATCH, BOUND = 64, 96, 16, 3, 1e-3


def _batch(rank: int, spread: float = 1e-5):
    """Inputs nearly equal across positions, targets of alternating sign (rank's own data)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, 1, D, generator=gen) + spread * torch.randn(BATCH, T, D, generator=gen)
    signs = torch.ones(T, 1)
    signs[1::2] = -1
    y = signs * torch.randn(BATCH, 1, P, generator=gen) + spread * torch.randn(BATCH, T, P, generator=gen)
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, P))


def _one_step(rank: int):
    """The parameters (whole) after one step of the model sharded by hand (σ = 0)."""
    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    x, y = _batch(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH), noise_multiplier=0.0,
            max_grad_norm=BOUND, grad_sample_mode="bk",
            loss_reduction="sum")
    optimizer.zero_grad()
    (module(x) * y).sum().backward()
    optimizer.step()
    return full_params(module)


def deferred_against_immediate(rank: int, world_size: int):
    """The parameters after one step with deferred checks and with immediate ones, and how many
    calls the deferred run recomputed."""
    recomputed = []
    original = deferred_checks._recompute_checked

    def counted(*args):
        recomputed.append(1)
        return original(*args)
    deferred_checks._recompute_checked = counted
    deferred = _one_step(rank)
    deferred_checks._recompute_checked = original
    passes.deferred_checks = lambda defer: trust.deferred_checks(False)
    immediate = _one_step(rank)
    passes.deferred_checks = trust.deferred_checks
    return {"start": [p.detach().clone() for p in _model().parameters()], "deferred": deferred,
            "immediate": immediate, "recomputed": len(recomputed)}
