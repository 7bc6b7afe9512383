"""nn.DataParallel replicas × user-level privacy units × BatchMemoryManager.

Protects: under ``nn.DataParallel`` (CPU harness, 3 replicas, uneven chunks, empty Poisson batches)
each *user's* gradient — the mean of its rows' gradients, its rows possibly split over replicas —
is clipped as one unit, the clipped sums are divided by the expected number of users, and the noise
is added once per logical step (std σ·C / E[users]), not once per replica or physical piece.

Oracle: a batch-size-1 autograd loop (``tests.privacy_units.oracle.unit_update``).
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from tests.distributed.cpu_data_parallel import CPUDataParallel
from tests.distributed.oracle import sgd_step
from tests.privacy_units.models import make_data, make_model
from tests.privacy_units.oracle import unit_update

LR, REPLICAS = 0.5, 3


def _private(model, order, clip, physical, **options):
    wrapped = CPUDataParallel(model, REPLICAS) if order == "before" else model
    dataset, users = make_data("mlp")
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, loader = PrivacyEngine().make_private(
            module=wrapped, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(dataset, batch_size=6), max_grad_norm=clip, grad_sample_mode="hooks",
            clipping="per_layer" if isinstance(clip, list) else "flat", privacy_unit="user",
            user_ids=users, max_examples_per_user=3, **options)
    net = CPUDataParallel(private, REPLICAS) if order == "after" else private
    batches = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) \
        if physical else None
    return net, optimizer, loader, batches


def _logical_steps(net, optimizer, loader, batches, steps):
    """Yield ``(x, y, unit sizes)`` of each logical step after it was taken."""
    xs, ys, sizes = [], [], []
    with (batches or _Plain(loader)) as physical:
        for x, y in physical:
            sizes += loader.unit_channel.latest().sizes()
            x = x.double()
            xs.append(x)
            ys.append(y)
            optimizer.zero_grad()
            taken = optimizer.steps_taken
            out = net(x)
            (nn.CrossEntropyLoss()(out, y) if len(x) else out.sum() * 0).backward()
            optimizer.step()
            if optimizer.steps_taken > taken:
                yield torch.cat(xs), torch.cat(ys), sizes
                xs, ys, sizes = [], [], []
            if optimizer.steps_taken == steps:
                return


class _Plain:
    def __init__(self, loader):
        self.loader = loader

    def __enter__(self):
        return self.loader

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("clip", [0.1, [0.05] * 4])
@pytest.mark.parametrize("physical", [None, 4])
def test_sigma_zero_update_equals_per_user_oracle(order, clip, physical):
    model = make_model("mlp").double()
    reference = copy.deepcopy(model)
    net, optimizer, loader, batches = _private(model, order, clip, physical, noise_multiplier=0.0)
    seen_users = 0
    for x, y, sizes in _logical_steps(net, optimizer, loader, batches, steps=5):
        seen_users += len(sizes)
        update = unit_update(reference, nn.CrossEntropyLoss(reduction="sum"), x, y, sizes, clip,
                             optimizer.expected_batch_size)
        sgd_step(reference, update, LR)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-12)
    assert seen_users > 0


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("physical", [None, 3])
def test_noise_is_added_once_per_logical_step(order, physical):
    """σ·C ≫ any clipped sum: the update's std is σ·C/E[users] (√3 larger if each replica noised,
    √pieces larger if each physical piece did)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 200), nn.Tanh(), nn.Linear(200, 60)).double()
    sigma, clip = 2.0, 1e-4
    net, optimizer, loader, batches = _private(model, order, clip, physical, noise_multiplier=sigma)
    ratios = []
    for _ in _logical_steps(net, optimizer, loader, batches, steps=3):
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        ratios.append(grads.std().item() / (sigma * clip / optimizer.expected_batch_size))
    assert len(ratios) == 3
    for ratio in ratios:
        assert 0.95 < ratio < 1.05, ratios
