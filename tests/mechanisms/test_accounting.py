"""Accounting of the mechanisms against Google dp-accounting (test-only reference)."""

import json
import math
import warnings

import dp_accounting
import pytest
import torch
import torch.nn as nn
from dp_accounting import pld
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine, cli
from opacus_dp.accountants import create_accountant
from opacus_dp.mechanisms.accounting import noise_multiplier_for, reduction_for

DELTA = 1e-5


def reference_epsilon(sigma, q, rounds):
    """dp-accounting PLD: PoissonSampled(Gaussian) self-composed ``rounds`` times."""
    accountant = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                   value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)
    return accountant.get_epsilon(DELTA)


def recorded(reduction, sigma, steps, name="prv"):
    accountant = create_accountant(name)
    for step in range(steps):
        accountant.record(reduction.event(step, sigma))
    return accountant


@pytest.mark.parametrize("sigma,q,bands,steps", [(1.1, 0.05, 4, 1000), (0.8, 0.2, 8, 203)])
def test_banded_reduction_matches_dp_accounting(sigma, q, bands, steps):
    accountant = recorded(reduction_for("banded", sample_rate=q, bands=bands), sigma, steps)
    assert len(accountant) == steps
    expected = reference_epsilon(sigma, q, math.ceil(steps / bands))
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=0.005)


def test_blt_is_one_gaussian_mechanism():
    accountant = recorded(reduction_for("blt", sample_rate=1.0), 2.0, 50)
    expected = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
    expected.compose(dp_accounting.GaussianDpEvent(2.0))
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected.get_epsilon(DELTA), rel=0.005)


@pytest.mark.parametrize("kind", ["banded", "blt", "tree"])
def test_calibration_reaches_the_target(kind):
    reduction = reduction_for(kind, sample_rate=0.1, bands=5)
    sigma = noise_multiplier_for(reduction, target_epsilon=3.0, target_delta=DELTA, steps=100, accountant="prv")
    eps = recorded(reduction, sigma, 100).get_epsilon(DELTA)
    assert 2.97 < eps <= 3.0


def test_engine_records_the_reduction_and_matches_dp_accounting():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(300, 4), torch.randint(0, 2, (300,)))
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        model, opt, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=30), target_epsilon=5.0, target_delta=DELTA,
            epochs=2, max_grad_norm=1.0, noise_mechanism="banded", bands=5)
    assert loader.sample_rate == pytest.approx(0.5) and len(loader) == 10
    for _ in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert len(engine.accountant) == 20
    eps = engine.get_epsilon(DELTA)
    assert eps == pytest.approx(reference_epsilon(opt.noise_multiplier, 0.5, 4), rel=0.005)
    assert eps <= 5.0


@pytest.mark.parametrize("kind,bands", [("blt", None), ("tree", None), ("banded", 1)])
def test_every_mechanism_spends_at_most_the_target(kind, bands):
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 2, (120,)))
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(secure_mode=kind == "tree")
        model, opt, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=20), target_epsilon=3.0, target_delta=DELTA,
            epochs=2, max_grad_norm=1.0, noise_mechanism=kind, bands=bands)
    for _ in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert 2.97 < engine.get_epsilon(DELTA) <= 3.0 and len(engine.accountant) == 12


def test_calculator_accounts_the_reduction(capsys):
    assert cli.main(["-r", "0.0125", "-n", "1.1", "--steps", "1000", "--noise-mechanism", "banded",
                     "--bands", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["accounted"] == [0.05, 250]
    assert report["epsilon"] == pytest.approx(reference_epsilon(1.1, 0.05, 250), rel=0.005)
    with pytest.raises(SystemExit):
        cli.main(["-r", "0.5", "-n", "1.1", "--steps", "10", "--noise-mechanism", "banded", "--bands", "3"])
