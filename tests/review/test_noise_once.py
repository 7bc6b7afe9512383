"""Noise std is σ·sensitivity / E|B| exactly once per logical step, however the step is cut.

Zero-gradient data (inputs 0 into bias-free linear layers) make every update pure noise;
its sample std over ≥ 36k coordinates is compared with the formula (5-sigma tolerance on
the std estimate: 5/√(2n) relative).
"""

import math

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.data import BatchMemoryManager

from tests.review.helpers import modern_engine, quiet

FEATURES, CLASSES, N = 150, 150, 64


def zero_gradient_setup(**kwargs):
    model = nn.Sequential(nn.Linear(FEATURES, FEATURES, bias=False),
                          nn.Linear(FEATURES, CLASSES, bias=False)).double()
    data = TensorDataset(torch.zeros(N, FEATURES, dtype=torch.float64), torch.arange(N) % CLASSES)
    engine = modern_engine(accountant="rdp")
    gsm, optimizer, loader = quiet(
        engine.make_private, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=16), noise_generator=torch.Generator().manual_seed(11),
        **kwargs)
    return engine, gsm, optimizer, loader


def assert_std(model, expected):
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    n = grad.numel()
    assert n >= 36_000
    assert abs(float(grad.std()) / expected - 1) < 5 / math.sqrt(2 * n)


def test_batch_memory_manager_adds_noise_once_per_logical_batch():
    sigma, bound = 1.7, 0.9
    engine, gsm, optimizer, loader = zero_gradient_setup(noise_multiplier=sigma, max_grad_norm=bound)
    physical = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as chunks:
        for x, y in chunks:
            physical += 1
            nn.functional.cross_entropy(gsm(x), y).backward()
            optimizer.step()
            if len(engine.accountant) == 1:
                break
            optimizer.zero_grad()
    assert physical > 1 and engine.accountant.history == [(sigma, 0.25, 1)]
    assert_std(gsm, sigma * bound / optimizer.expected_batch_size)


@pytest.mark.parametrize("bounds", [[0.3, 1.2], [0.5, 0.5]])
def test_per_layer_clipping_noise_uses_the_norm_of_the_bounds(bounds):
    sigma = 0.9
    engine, gsm, optimizer, loader = zero_gradient_setup(noise_multiplier=sigma, max_grad_norm=bounds,
                                                         clipping="per_layer")
    x, y = next(iter(loader))
    nn.functional.cross_entropy(gsm(x), y).backward()
    optimizer.step()
    assert_std(gsm, sigma * math.sqrt(sum(b * b for b in bounds)) / optimizer.expected_batch_size)
