"""Rank functions for the distributed tests of the norms-only modes (see ``test_distributed``).

Each rank trains on its own Poisson batches (different data per rank, clipping on, σ = 0)
with ``grad_sample_mode="bk"`` (or ``"ghost"``) and reports its batches and parameters, as the workers of
``tests/distributed`` do for the hooks mode.
"""

import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from tests.distributed.workers import (
    LR, N_CLASSES, N_FEATURES, N_SAMPLES, _clipping_args, dataset, make_model, params_of, wrap)

POSITIONS = 12


class PositionsMean(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def make_sequence_model(seed: int) -> nn.Module:
    """Two Linear layers over POSITIONS positions (per-layer clipping forms their per-sample
    gradients in chunks on CPU), a head on the pooled vectors; float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 8), PositionsMean(),
                         nn.Linear(8, N_CLASSES)).double()


def sequence_dataset(seed: int = 4321) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, POSITIONS, N_FEATURES, generator=g, dtype=torch.float64) * 3
    return TensorDataset(x, torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=g))


def train_bk(rank, world_size, wrapper, clipping, mode="bk", steps=2, physical=2,
             model_fn=make_model, data=None):
    model = wrap(model_fn(seed=100 + rank), wrapper)
    start = params_of(model)
    data = dataset() if data is None else data
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    torch.manual_seed(7 + rank)
    result = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=_clipping_args(clipping, len(start)), clipping=clipping,
        grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
    gsm, optimizer, dp_loader = result[0], result[1], result[-1]
    criterion = result[2] if mode == "ghost" else nn.CrossEntropyLoss()
    logical, current, modes = [], [], {}
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=physical,
                            optimizer=optimizer) as physical_loader:
        for x, y in physical_loader:
            current.append((x, y))
            optimizer.zero_grad()
            criterion(gsm(x), y).backward()
            modes.update(gsm.layer_modes())
            before = len(engine.accountant)
            optimizer.step()
            if len(engine.accountant) > before:
                logical.append(current)
                current = []
            if len(logical) == steps:
                break
    return {"start": start, "batches": logical, "final": params_of(gsm),
            "global_batch": optimizer.expected_batch_size * world_size,
            "all_reduces": optimizer.reducer.num_all_reduces,
            "mode": type(gsm).__name__, "skips": gsm.skips_weight_grads, "layer_modes": modes}


def bk_job(rank, world_size):
    """bk with both wrappers and clippings; ghost (two-pass backward, one pass under DDP); bk
    with per-layer clipping on a sequence model (chunked per-sample gradients)."""
    results = {(wrapper, clipping, "bk"): train_bk(rank, world_size, wrapper, clipping)
               for wrapper in ("ddp", "dpddp") for clipping in ("flat", "per_layer")}
    for wrapper in ("ddp", "dpddp"):
        results[(wrapper, "flat", "ghost")] = train_bk(rank, world_size, wrapper, "flat", "ghost")
        results[(wrapper, "per_layer", "bk-sequence")] = train_bk(
            rank, world_size, wrapper, "per_layer", model_fn=make_sequence_model, data=sequence_dataset())
    return results
