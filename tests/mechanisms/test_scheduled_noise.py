"""Noise and clipping-bound schedulers with correlated noise: every released step is accounted
at least as the exact analysis of the noise it was released with."""

import dp_accounting
import pytest
import torch
import torch.nn as nn
from dp_accounting.pld import pld_privacy_accountant
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.mechanisms import toeplitz
from opacus_dp.schedulers import ExponentialGradClip, ExponentialNoise

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
DELTA = 1e-5


def _train(mechanism, scheduler, **kwargs):
    """Six steps with ``scheduler`` stepped after every step; the σ and bound of each released
    step (a refusal may end the run early)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=2.0, max_grad_norm=1.0, epochs=1, noise_mechanism=mechanism, **kwargs)
    schedule = scheduler(opt, gamma=0.6)
    released, refused = [], None
    try:
        for x, y in loader:
            if len(released) == 6:
                break
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            settings = (opt.noise_multiplier, opt.max_grad_norm)
            opt.step()
            released.append(settings)
            schedule.step()
    except ValueError as error:
        refused = error
    assert opt.steps_taken == len(released) == len(engine.accountant)
    assert refused is None or "noise_mechanism=" in str(refused)
    return engine, opt, loader, released


def _epsilon(event) -> float:
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("scheduler", [ExponentialNoise, ExponentialGradClip])
def test_blt_steps_are_accounted_as_the_exact_gaussian_mechanism(scheduler):
    engine, opt, _, released = _train("blt", scheduler)
    strategy = opt.noise.strategy
    k, period = len(released), strategy.period
    sigmas = torch.tensor([s for s, _ in released], dtype=torch.float64)
    bounds = torch.tensor([c for _, c in released], dtype=torch.float64)
    # y = C x + w, row r's noise std σ_r C_r Δ, column s's input bounded by C_s; all entries of C are ≥ 0
    matrix = toeplitz.dense(strategy.column(strategy.steps).double(), strategy.steps)[:k, :k]
    scaled = matrix * bounds[None, :] / (sigmas * bounds * strategy.sensitivity)[:, None]
    mu = max(scaled[:, g::period].sum(1).norm().item() for g in range(min(period, k)))
    assert engine.get_epsilon(DELTA) >= _epsilon(dp_accounting.GaussianDpEvent(1 / mu)) * (1 - 1e-3)


def test_banded_steps_are_accounted_at_least_as_their_own_row():
    engine, opt, loader, released = _train("banded", ExponentialNoise, bands=2)
    # row t of y = C x + w holds the example of group t mod b only through x_t: a subsampled Gaussian
    sigma = min(s for s, _ in released) * opt.noise.strategy.sensitivity
    row = dp_accounting.PoissonSampledDpEvent(loader.sample_rate, dp_accounting.GaussianDpEvent(sigma))
    assert engine.get_epsilon(DELTA) >= _epsilon(row) * (1 - 1e-3)


def _made_private(sigma, model):
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 2)
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=sigma, max_grad_norm=1.0, epochs=1, noise_mechanism="blt")
    return engine, model, opt, loader


def _steps(model, opt, loader, count, sigmas):
    for x, y in loader:
        if len(sigmas) == count:
            return
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        sigma = opt.noise_multiplier
        opt.step()
        sigmas.append(sigma)


def test_a_run_resumed_with_another_sigma_is_accounted_for_it_or_refused(tmp_path):
    engine, model, opt, loader = _made_private(2.0, nn.Linear(4, 2))
    sigmas = []
    _steps(model, opt, loader, 3, sigmas)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=opt)
    engine, model, opt, loader = _made_private(0.5, nn.Linear(4, 2))
    try:
        engine.load_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=opt)
        _steps(model, opt, loader, opt.noise.strategy.steps, sigmas)
    except (ValueError, RuntimeError) as error:
        assert "noise" in str(error)
    if opt.steps_taken > 3:  # the resumed steps' rows alone are a Gaussian mechanism of their σ
        assert len(engine.accountant) == len(sigmas)
        row = dp_accounting.GaussianDpEvent(min(sigmas) * opt.noise.strategy.sensitivity)
        assert engine.get_epsilon(DELTA) >= _epsilon(row) * (1 - 1e-3)
