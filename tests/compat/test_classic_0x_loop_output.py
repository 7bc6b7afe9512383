"""What an Opacus 0.14 training loop prints when it runs on opacus_dp unchanged.

The loop of Opacus 0.14's own examples: ``DataLoader(dataset, batch_sampler=
UniformWithReplacementSampler(num_samples=N, sample_rate=q))`` and ``PrivacyEngine(model,
sample_rate=q, alphas=..., noise_multiplier=σ, max_grad_norm=C)`` (``poisson`` left at its
default, no ``sample_size``), then ``get_privacy_spent(δ)`` printed as ``ε = … for α = …``.
Its batches are Poisson batches of rate q, which is what the accountant assumes, so nothing
should say otherwise; and ``get_privacy_spent`` before the first step has no undefined order.
"""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import RDPAccountant
from opacus_dp.data import SamplingWarning
from opacus_dp.utils.uniform_sampler import UniformWithReplacementSampler

N, BATCH, SIGMA, DELTA = 256, 32, 1.1, 1e-5
# 0.x scripts leave secure_mode off (its reminder is tested in tests/engine/test_secure_mode_notice.py)
pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # Opacus 0.14's example orders


def _engine_and_loader():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 16), torch.randint(0, 2, (N,)))
    sampler = UniformWithReplacementSampler(num_samples=N, sample_rate=BATCH / N,
                                            generator=torch.Generator().manual_seed(0))
    loader = DataLoader(data, batch_sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = PrivacyEngine(model, sample_rate=BATCH / N, alphas=ALPHAS, noise_multiplier=SIGMA,
                           max_grad_norm=1.0, secure_rng=False)
    return engine, model, optimizer, loader


def _train(model, optimizer, loader) -> int:
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    return steps


def test_a_0x_poisson_loop_gets_no_sampling_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, model, optimizer, loader = _engine_and_loader()
        engine.attach(optimizer)
        steps = _train(model, optimizer, loader)
    sampling = [str(w.message) for w in caught if issubclass(w.category, SamplingWarning)]
    assert sampling == []
    # Accounted as what the loop did: `steps` Poisson steps of (σ, q), RDP at the engine's orders.
    reference = RDPAccountant(alphas=ALPHAS)
    for _ in range(steps):
        reference.step(noise_multiplier=SIGMA, sample_rate=BATCH / N)
    assert engine.get_privacy_spent(DELTA) == reference.get_privacy_spent(delta=DELTA, alphas=ALPHAS)


def test_a_0x_loop_without_the_sampler_is_still_warned():
    """The warning stays where it is true: fixed-size shuffled batches are not Poisson batches."""
    engine, model, optimizer, _ = _engine_and_loader()
    shuffled = DataLoader(TensorDataset(torch.randn(N, 16), torch.randint(0, 2, (N,))), batch_size=BATCH,
                          shuffle=True)
    with pytest.warns(SamplingWarning, match="poisson=False"):
        engine.attach(optimizer)
        _train(model, optimizer, shuffled)


def test_privacy_spent_before_the_first_step_names_an_order():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, optimizer, _ = _engine_and_loader()
        engine.attach(optimizer)
    epsilon, best_alpha = engine.get_privacy_spent(DELTA)
    assert epsilon == 0.0  # nothing released yet
    assert math.isfinite(best_alpha) and best_alpha in ALPHAS
    assert "nan" not in f"ε = {epsilon:.2f} for α = {best_alpha}"


def test_the_0x_poisson_loop_with_poisson_and_sample_size_is_quiet_and_exact():
    """``poisson=True, sample_size=N`` given explicitly (what docs/migration.md says to pass when
    the sampler is not recognised) with the same loader runs without a sampling warning and
    accounts every step, empty draws included."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 16), torch.randint(0, 2, (N,)))
    loader = DataLoader(data, batch_sampler=UniformWithReplacementSampler(
        num_samples=N, sample_rate=BATCH / N, generator=torch.Generator().manual_seed(0)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = PrivacyEngine(model, sample_rate=BATCH / N, sample_size=N, poisson=True, alphas=ALPHAS,
                               noise_multiplier=SIGMA, max_grad_norm=1.0)
        engine.attach(optimizer)
        steps = _train(model, optimizer, loader)
        engine.detach()
    assert [w for w in caught if issubclass(w.category, SamplingWarning)] == []
    draws = UniformWithReplacementSampler(num_samples=N, sample_rate=BATCH / N, skip_empty=False,
                                          generator=torch.Generator().manual_seed(0))
    assert engine.steps == len(list(draws)) >= steps  # every draw is one step, empty ones too
