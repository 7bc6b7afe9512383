"""The audit at user level: canary users of several examples through ``make_private(privacy_unit="user")``.

Oracles: the canary rows' gradients by autograd; without noise, what a step must add to a canary
user's coordinate by hand (``C`` once per sampled user under user-level clipping, ``C`` per
sampled example when examples are clipped one by one); the user-level ε against Google
``dp-accounting`` (PLD of the Poisson-subsampled Gaussian at the users' rate) and, at q = 1, the
exact ε of the Gaussian mechanism. The audits are seeded; each bound holds with probability
≥ 95 % (Clopper–Pearson limits, ``confidence=0.95``), so an honest engine fails one of these
checks with probability ≤ 5 % per seed. Over 10 other seeds of the same configurations the honest
bounds stayed in [1.8, 3.3] (claimed ε 3.92 and 5.22) and the per-example variants' in [5.7, 8.1].
"""

import numpy as np
import pytest
import torch

from opacus_dp.audit import AuditConfig, CanaryLayout, CanaryLoss, canary_model, run_audit, user_canary_dataset
from opacus_dp.audit.cli import main
from opacus_dp.audit.runner import run_with_canaries
from opacus_dp.data import unit_sampling
from opacus_dp.maths.unit_groups import UnitGroups
from tests.audit.configurations import assert_never_above_the_accountant

USERS = dict(privacy_unit="user", canary_examples_per_user=2)
FULL_BATCH_USERS = dict(USERS, noise_multiplier=2.2, steps=4, canaries_per_run=500, num_runs=2)
POISSON_USERS = dict(privacy_unit="user", canary_examples_per_user=4, noise_multiplier=1.5, steps=8,
                     sample_rate=0.5, canaries_per_run=2000, num_runs=8)


def test_a_canary_user_owns_its_examples_and_only_it_touches_its_coordinate():
    layout = CanaryLayout(num_canaries=4, num_background=5, background_dim=3, gradient_scale=2.0)
    member = torch.tensor([False, True, False, True])
    data = user_canary_dataset(layout, member, examples_per_user=3, max_grad_norm=0.5,
                               generator=torch.Generator().manual_seed(0))
    assert len(data) == 2 * 3 + 5
    assert data.user_ids.tolist() == [1, 1, 1, 3, 3, 3, 4, 4, 4, 5, 5]  # background: users of 3 rows
    model = canary_model(layout)
    torch.nn.init.normal_(model.weight)
    for row in range(len(data)):
        x, y = data[row]
        model.zero_grad()
        CanaryLoss("sum")(model(x[None]), y[None]).backward()
        grad = model.weight.grad[0]
        if row < 6:  # canary user 1 (rows 0-2), then 3 (rows 3-5)
            expected = torch.zeros(layout.input_dim, dtype=torch.float64)
            expected[3 + (1 if row < 3 else 3)] = -2.0 * 0.5
            torch.testing.assert_close(grad, expected)
        else:
            assert torch.all(grad[3:] == 0) and grad.norm() > 0.5


def _no_noise(**overrides):
    arguments = dict(USERS, noise_multiplier=0.0, steps=3, canaries_per_run=30, num_background=12,
                     max_grad_norm=0.5, canary_examples_per_user=3)
    arguments.update(overrides)
    return run_with_canaries(AuditConfig(**arguments), report_epsilon=False)


@pytest.mark.parametrize("engine", [
    dict(), dict(grad_sample_mode="ghost"), dict(grad_sample_mode="bk"), dict(grad_sample_mode="functorch"),
    dict(unit_gradient="sum", max_examples_per_user=2), dict(loss_reduction="sum", max_physical_batch_size=7),
], ids=["hooks", "ghost", "bk", "functorch", "sum of 2 of 3", "sum loss, physical batches of 7"])
def test_without_noise_a_canary_user_adds_its_bound_once(engine):
    """σ = 0, q = 1: clipped as one unit, a present user of 3 examples moves its coordinate by C."""
    record = _no_noise(**engine)
    torch.testing.assert_close(record.observations, record.membership.double().expand(3, -1), rtol=0, atol=1e-5)
    assert record.privacy_history == [(0.0, 1.0, 3)]


def test_without_noise_per_example_clipping_adds_the_bound_per_example():
    record = _no_noise(user_mechanism="per_example")
    torch.testing.assert_close(record.observations, 3.0 * record.membership.double().expand(3, -1),
                               rtol=0, atol=1e-5)


class _EveryRowItsOwnUnit(UnitGroups):
    """A broken grouping: the rows of a sampled user are clipped one by one (weights 1)."""

    @classmethod
    def from_sizes(cls, sizes, unit_gradient="mean"):
        return UnitGroups.from_sizes([1] * sum(sizes), "sum")


@pytest.mark.parametrize("cap,expected", [(None, 4.0), (2, 2.0), (1, 1.0)])
def test_a_user_never_acts_through_more_than_k_examples(monkeypatch, cap, expected):
    """Counted through the broken grouping: each row that enters a step adds C."""
    monkeypatch.setattr(unit_sampling, "UnitGroups", _EveryRowItsOwnUnit)
    record = _no_noise(canary_examples_per_user=4, max_examples_per_user=cap)
    torch.testing.assert_close(record.observations, expected * record.membership.double().expand(3, -1),
                               rtol=0, atol=1e-5)


def test_poisson_without_noise_users_are_sampled_whole():
    record = _no_noise(steps=40, sample_rate=0.25, canaries_per_run=60, num_background=4)
    x, member = record.observations.numpy(), record.membership.numpy()
    assert np.allclose(x[:, ~member], 0.0, atol=1e-6)
    assert np.allclose(x * (1 - x), 0.0, atol=1e-5)  # 0 or 1: the user is in or out, never partly
    assert abs(x[:, member].mean() - 0.25) < 0.05  # ≈ 1200 Bernoulli(1/4) draws: sd ≈ 0.0125
    variant = _no_noise(steps=40, sample_rate=0.25, canaries_per_run=60, num_background=4, user_mechanism="per_example")
    counts = variant.observations.numpy()[:, variant.membership.numpy()]
    assert np.allclose(counts, np.round(counts), atol=1e-5) and counts.max() >= 2  # Binomial(3, 1/4)
    assert abs(counts.mean() - 0.75) < 0.1  # sd ≈ 0.02


def _pld_epsilon(sigma, q, steps, delta):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant.compose(dp_event.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("arguments", [dict(FULL_BATCH_USERS, seed=51), dict(POISSON_USERS, seed=52)],
                         ids=["full batch", "Poisson users"])
def test_user_level_audit_stays_below_the_user_level_epsilon(arguments):
    report = run_audit(AuditConfig(**arguments))
    c = report.config
    assert report.accountant_epsilon == pytest.approx(
        _pld_epsilon(c.noise_multiplier, c.sample_rate, c.steps, c.delta), rel=1e-2)
    assert_never_above_the_accountant(report)
    assert not report.violates_claim
    power = 0.5 if c.sample_rate == 1.0 else 0.3
    assert report.epsilon_lower_bound >= power * report.accountant_epsilon, report


@pytest.mark.parametrize("arguments", [dict(FULL_BATCH_USERS, seed=53), dict(POISSON_USERS, seed=54)],
                         ids=["full batch", "Poisson"])
def test_per_example_clipping_claimed_per_user_is_caught(arguments):
    honest = run_audit(AuditConfig(**arguments))
    broken = run_audit(AuditConfig(**arguments, user_mechanism="per_example"))
    assert broken.accountant_epsilon == pytest.approx(honest.accountant_epsilon)  # the same claim
    assert not honest.violates_claim
    assert broken.violates_claim and broken.epsilon_lower_bound > broken.accountant_epsilon, broken


def test_user_sampling_with_per_example_clipping_is_caught(monkeypatch):
    arguments = dict(FULL_BATCH_USERS, seed=55)
    honest = run_audit(AuditConfig(**arguments))
    monkeypatch.setattr(unit_sampling, "UnitGroups", _EveryRowItsOwnUnit)
    broken = run_audit(AuditConfig(**arguments))
    assert broken.accountant_epsilon == honest.accountant_epsilon and not honest.violates_claim
    assert broken.violates_claim, broken


def test_command_line_reports_the_user_level_audit(capsys):
    argv = ["--noise-multiplier", "2.2", "--steps", "4", "--canaries-per-run", "300", "--runs", "2",
            "--privacy-unit", "user", "--canary-examples-per-user", "3", "--max-examples-per-user", "2",
            "--seed", "6"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    expected = run_audit(AuditConfig(noise_multiplier=2.2, steps=4, canaries_per_run=300, num_runs=2, seed=6,
                                     privacy_unit="user", canary_examples_per_user=3, max_examples_per_user=2))
    assert "privacy unit: user (3 canary examples per canary user, at most 2 per step" in text
    assert f"{expected.epsilon_lower_bound:.3f}  <- headline" in text
    with pytest.raises(SystemExit):
        main(["--noise-multiplier", "1", "--steps", "2", "--canary-examples-per-user", "3"])
    assert "--privacy-unit user" in capsys.readouterr().err


@pytest.mark.parametrize("bad,match", [
    (dict(privacy_unit="writer"), "privacy_unit"),
    (dict(canary_examples_per_user=3), "privacy_unit='user'"),
    (dict(user_mechanism="per_example"), "privacy_unit='user'"),
    (dict(USERS, canary_examples_per_user=1), "canary_examples_per_user"),
    (dict(USERS, max_examples_per_user=0), "max_examples_per_user"),
    (dict(USERS, unit_gradient="max"), "unit_gradient"),
    (dict(USERS, user_mechanism="fake"), "user_mechanism"),
    (dict(USERS, api="classic", accountant="rdp"), "api='modern'"),
])
def test_bad_user_level_configurations_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        AuditConfig(noise_multiplier=1.0, steps=2, **bad)
