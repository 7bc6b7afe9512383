"""σ calibrated for a budget must hold for the number of steps the run really takes.

Oracle: a fresh accountant fed exactly the steps the returned loader performs in ``epochs``
passes (``epochs · len(loader)`` records of ``(σ, q)``), at the calibrated σ.
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import create_accountant
from opacus_dp.data import DPDataLoader, UniformWithReplacementSampler

from tests.review.helpers import modern_engine, quiet, tiny_dataset, tiny_model

TARGET, DELTA = 2.0, 1e-5


def epsilon_of_run(mechanism, sigma, sample_rate, steps):
    accountant = quiet(create_accountant, mechanism)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("make_loader, epochs", [
    # round(1/0.35) = 3 Poisson batches per pass, int(1/0.35) = 2
    (lambda: DPDataLoader(tiny_dataset(100), sample_rate=0.35), 10),
    # 1/(1/75) is not exactly 75 in floating point: 3 passes are 225 steps, not 224
    (lambda: DataLoader(tiny_dataset(300), batch_size=4), 3),
    (lambda: DataLoader(tiny_dataset(100), batch_size=7), 4),
])
def test_make_private_with_epsilon_holds_for_the_steps_of_the_loader(make_loader, epochs):
    model = tiny_model()
    engine = modern_engine(accountant="rdp")
    gsm, optimizer, loader = quiet(
        engine.make_private_with_epsilon, module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=make_loader(),
        target_epsilon=TARGET, target_delta=DELTA, epochs=epochs, max_grad_norm=1.0)
    steps = epochs * len(loader)
    assert epsilon_of_run("rdp", optimizer.noise_multiplier, loader.sample_rate, steps) <= TARGET


def test_make_private_with_epsilon_keeps_the_steps_of_a_dp_data_loader():
    """A DPDataLoader with its own number of steps per pass keeps it (and σ accounts for it)."""
    model = tiny_model()
    engine = modern_engine(accountant="rdp")
    source = DPDataLoader(tiny_dataset(100), sample_rate=0.1, steps=25)
    gsm, optimizer, loader = quiet(
        engine.make_private_with_epsilon, module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=source,
        target_epsilon=TARGET, target_delta=DELTA, epochs=2, max_grad_norm=1.0)
    assert len(loader) == 25 and loader.sample_rate == 0.1
    assert epsilon_of_run("rdp", optimizer.noise_multiplier, 0.1, 2 * 25) <= TARGET


@pytest.mark.parametrize("batch_size, sample_size, poisson, epochs", [
    (32, 100, False, 5),   # a DataLoader(batch_size=32) over 100 examples: 4 batches per pass
    (35, 100, True, 4),    # UniformWithReplacementSampler(q=0.35): 3 batches per pass
    (5, 100, False, 3),
])
def test_classic_target_epsilon_holds_for_the_batches_of_one_pass(batch_size, sample_size, poisson, epochs):
    engine = quiet(PrivacyEngine, tiny_model(), batch_size=batch_size, sample_size=sample_size,
                   max_grad_norm=1.0, target_epsilon=TARGET, target_delta=DELTA, epochs=epochs,
                   poisson=poisson)
    data = tiny_dataset(sample_size)
    if poisson:
        q = batch_size / sample_size
        loader = DataLoader(data, batch_sampler=UniformWithReplacementSampler(num_samples=sample_size,
                                                                              sample_rate=q))
    else:
        loader = DataLoader(data, batch_size=batch_size)
    steps = epochs * len(loader)
    assert steps >= math.floor(epochs * sample_size / batch_size)
    eps = epsilon_of_run("rdp", engine.noise_multiplier, engine.sample_rate, steps)
    assert eps <= TARGET
