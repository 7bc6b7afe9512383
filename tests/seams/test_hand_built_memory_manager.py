"""A hand-built Opacus 1.x stack (the objects ``import opacus`` resolves to under
``install_as_opacus``): ``GradSampleModule`` + ``optimizers.DPOptimizer`` + Poisson ``DPDataLoader`` +
``utils.batch_memory_manager.BatchMemoryManager`` + ``RDPAccountant`` hooked with
``get_optimizer_hook_fn``.

Protects: one accountant record of rate q per *logical* batch (empty Poisson batches included,
never one per physical piece), the σ = 0 update of each logical batch equal to the clipped sum of
its examples' gradients (autograd loop) over the expected batch size, and the noise added once per
logical batch (std σ·C/B, not √pieces larger).
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.accountants import RDPAccountant
from opacus_dp.data_loader import DPDataLoader
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optimizers import DPOptimizer, DPPerLayerOptimizer
from opacus_dp.utils.batch_memory_manager import BatchMemoryManager
from tests.distributed.oracle import clipped_mean_update, sgd_step

LR = 0.5


def _stack(model, n, batch_size, sigma, clip, width):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, width, generator=g, dtype=torch.float64) * 3,
                         torch.randint(0, 3, (n,), generator=g))
    loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=batch_size),
                                           generator=torch.Generator().manual_seed(5))
    gsm = GradSampleModule(model)
    optimizer_class = DPPerLayerOptimizer if isinstance(clip, list) else DPOptimizer
    optimizer = optimizer_class(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=sigma,
                                max_grad_norm=clip, expected_batch_size=batch_size)
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=loader.sample_rate))
    return gsm, optimizer, loader, accountant


def _logical_batches(gsm, optimizer, loader, accountant, physical):
    """Yield the pieces ``[(x, y), ...]`` of each logical batch after its step was recorded."""
    pieces = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            recorded = len(accountant)
            out = gsm(x)
            (nn.CrossEntropyLoss()(out, y) if len(x) else out.sum() * 0).backward()
            optimizer.step()
            pieces.append((x, y))
            if len(accountant) > recorded:
                assert len(accountant) == recorded + 1
                yield pieces
                pieces = []
    assert not pieces, "physical batches left without a recorded step"


@pytest.mark.parametrize("clip", [0.1, [0.05] * 4])
@pytest.mark.parametrize("batch_size,physical", [(1, 1), (4, 3), (4, 100)])
def test_one_record_per_logical_batch_and_clipped_mean_update(clip, batch_size, physical):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    reference = copy.deepcopy(model)
    gsm, optimizer, loader, accountant = _stack(model, 40, batch_size, 0.0, clip, width=6)
    sizes = []
    for pieces in _logical_batches(gsm, optimizer, loader, accountant, physical):
        x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        sizes.append(len(x))
        if len(x):
            sgd_step(reference, clipped_mean_update(reference, nn.CrossEntropyLoss(reduction="sum"), x, y, clip,
                                                    batch_size), LR)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-12)
    assert accountant.history == [(0.0, loader.sample_rate, len(loader))]
    assert len(sizes) == len(loader)
    if batch_size == 1:
        assert 0 in sizes, "the seed must give an empty Poisson batch"
    if physical < 100:
        assert max(sizes) > physical, "some logical batch must be split"


@pytest.mark.parametrize("physical", [7, 1000])
def test_noise_is_added_once_per_logical_batch(physical):
    torch.manual_seed(0)
    model = nn.Linear(50, 100).double()
    sigma, clip, batch_size = 2.0, 1e-4, 40
    gsm, optimizer, loader, accountant = _stack(model, 400, batch_size, sigma, clip, width=50)
    ratios = []
    for _ in _logical_batches(gsm, optimizer, loader, accountant, physical):
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        ratios.append(grads.std().item() / (sigma * clip / batch_size))
    assert len(ratios) == len(loader) == len(accountant)
    assert all(0.95 < r < 1.05 for r in ratios), ratios
