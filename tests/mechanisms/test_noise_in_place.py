"""The step adds its noise into the clipped sums in place where no ``p.summed_grad`` shows them,
else into a new tensor: the same numbers either way, and ``p.summed_grad`` never holds noise."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from opacus_dp.optim.summed_grad_views import SummedGradViews

BOUND, SIGMA, BATCH = 0.5, 1.0, 8
NOISES = {True: ParallelGaussianNoise, "philox": PhiloxGaussianNoise}


def data():
    generator = torch.Generator().manual_seed(5)
    return torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)


def modern_run(fast_noise, steps=2, seed=None):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=BOUND, fast_noise=fast_noise, poisson_sampling=False,
            noise_generator=None if seed is None else torch.Generator().manual_seed(seed))
    for step, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        if step + 1 == steps:
            return model, optimizer, (xb, yb)


def classic_run(fast_noise=False, steps=2, seed=None, kinds=None):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=BATCH, sample_size=32, noise_multiplier=SIGMA,
                               max_grad_norm=BOUND, poisson=False, fast_noise=fast_noise,
                               noise_generator=None if seed is None else torch.Generator().manual_seed(seed))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine.attach(optimizer)
    if kinds is not None:
        kinds.append(type(optimizer.privacy_engine._dp_optimizer.noise))
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[step * BATCH:(step + 1) * BATCH]),
                                    y[step * BATCH:(step + 1) * BATCH]).backward()
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    engine.detach()
    return params


def clipped_sum(model, xb, yb):
    """Oracle: per-sample gradients by an autograd loop, clipped by hand, summed."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(xb)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xb[i:i + 1]), yb[i:i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, BOUND / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("fast_noise", [False, True, "philox"])
def test_summed_grad_keeps_the_clipped_sum_without_noise(fast_noise):
    model, optimizer, (xb, yb) = modern_run(fast_noise, steps=1)
    before = [p.detach().clone() + 0.1 * p.grad for p in model.parameters()]  # parameters before the step
    with torch.no_grad():
        for p, value in zip(model.parameters(), before):
            p.copy_(value)
    expected = clipped_sum(model, xb, yb)
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.summed_grad, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(p.grad * BATCH, want, atol=1e-3)  # the gradient holds the noise


def record_reuse(monkeypatch, never_in_place: bool):
    """Record which way each tensor was noised; optionally pretend every sum is shown."""
    seen = []
    original = SummedGradViews.exposes

    def exposes(self, tensor):
        shown = True if never_in_place else original(self, tensor)
        seen.append(not shown)
        return shown
    monkeypatch.setattr(SummedGradViews, "exposes", exposes)
    return seen


def test_classic_lifecycle_noises_in_place_with_the_same_numbers(monkeypatch):
    in_place = record_reuse(monkeypatch, never_in_place=False)
    params_in_place = classic_run()
    assert in_place and all(in_place)  # the 0.x lifecycle shows no sums after the step
    monkeypatch.undo()
    copied = record_reuse(monkeypatch, never_in_place=True)
    params_copied = classic_run()
    assert copied and not any(copied)
    for a, b in zip(params_in_place, params_copied):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fast_noise", [False, "philox"])
def test_modern_lifecycle_noises_into_new_tensors(monkeypatch, fast_noise):
    seen = record_reuse(monkeypatch, never_in_place=False)
    modern_run(fast_noise)
    assert seen and not any(seen)  # make_private shows p.summed_grad: never written with noise


@pytest.mark.parametrize("fast_noise", [True, "philox"])
def test_classic_engine_draws_the_fast_noise_of_make_private(monkeypatch, fast_noise):
    in_place, kinds = record_reuse(monkeypatch, never_in_place=False), []
    classic = classic_run(fast_noise, steps=2, seed=11, kinds=kinds)
    assert kinds == [NOISES[fast_noise]] and in_place and all(in_place)
    model, _, _ = modern_run(fast_noise, steps=2, seed=11)  # same data order, seed and divisor
    for a, b in zip(classic, model.parameters()):
        assert torch.equal(a, b.detach())  # the same numbers, in place or not
    default = classic_run(False, steps=2, seed=11)
    assert not any(torch.allclose(a, b) for a, b in zip(classic, default))  # another stream


def test_classic_engine_refuses_other_fast_noise_values():
    with warnings.catch_warnings(), pytest.raises(ValueError, match="fast_noise"):
        warnings.simplefilter("ignore")
        PrivacyEngine(nn.Linear(2, 2), batch_size=2, sample_size=8, noise_multiplier=1.0, max_grad_norm=1.0,
                      fast_noise="fast")
