"""User-level sampling is accounted per user: ε equals Google dp-accounting's PLD (and RDP)
accounting of the Poisson(q_u)-subsampled Gaussian composed over the steps taken."""

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

dp_accounting = pytest.importorskip("dp_accounting")

from opacus_dp import PrivacyEngine  # noqa: E402
from tests.privacy_units.models import make_data, make_model  # noqa: E402

SIGMA, DELTA = 1.1, 1e-5


def _trained(accountant: str, steps: int = 6):
    dataset, users = make_data("mlp")
    model = make_model("mlp")
    engine = PrivacyEngine(accountant=accountant)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=9), noise_multiplier=SIGMA, max_grad_norm=1.0,
        privacy_unit="user", user_ids=users, max_examples_per_user=2)
    taken = 0
    while taken < steps:
        for x, y in loader:
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
            if taken == steps:
                break
    return engine, loader, taken


def _reference(q: float, steps: int, kind: str) -> float:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(SIGMA)), steps)
    if kind == "pld":
        reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        reference = dp_accounting.rdp.RdpAccountant(list(range(2, 256)) + [x / 10 for x in range(11, 20)])
    return reference.compose(event).get_epsilon(DELTA)


def test_prv_epsilon_equals_dp_accounting_pld():
    engine, loader, steps = _trained("prv")
    q = loader.sample_rate
    assert q == pytest.approx(1 / 4) and engine.accountant.history == [(SIGMA, q, steps)]
    assert engine.accountant.privacy_unit == "user"
    assert engine.get_epsilon(DELTA) == pytest.approx(_reference(q, steps, "pld"), rel=0.02)


def test_rdp_epsilon_equals_dp_accounting_rdp():
    engine, loader, steps = _trained("rdp")
    assert engine.get_epsilon(DELTA) == pytest.approx(_reference(loader.sample_rate, steps, "rdp"), rel=0.02)


def test_user_level_run_reports_its_unit_only():
    engine, _, _ = _trained("rdp", steps=2)
    epsilon = engine.get_epsilon(DELTA)
    assert engine.get_epsilon(DELTA, privacy_unit="user") == epsilon
    with pytest.raises(ValueError, match="per user"):
        engine.get_epsilon(DELTA, privacy_unit="example")
    with pytest.raises(ValueError, match="already accounts per user"):
        engine.get_epsilon(DELTA, privacy_unit="user", max_examples_per_user=3)
