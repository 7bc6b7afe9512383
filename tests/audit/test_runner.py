"""The canary task through the real engine: what the white-box adversary observes."""

import numpy as np
import pytest
import torch

from opacus_dp.audit import AuditConfig, CanaryLayout, CanaryLoss, canary_dataset, canary_model
from opacus_dp.audit.canaries import draw_membership
from opacus_dp.audit.runner import run_with_canaries


def test_canary_gradient_is_a_scaled_unit_vector_of_its_own_coordinate():
    layout = CanaryLayout(num_canaries=5, num_background=6, background_dim=3, gradient_scale=2.5)
    member = torch.tensor([True, False, True, True, False])
    data = canary_dataset(layout, member, max_grad_norm=0.7, generator=torch.Generator().manual_seed(0))
    assert len(data) == 3 + 6
    model = canary_model(layout)
    torch.nn.init.normal_(model.weight)  # the gradient must not depend on the weights
    for row, canary in enumerate([0, 2, 3]):  # present canaries first, in index order
        x, y = data[row]
        model.zero_grad()
        CanaryLoss("sum")(model(x[None]), y[None]).backward()
        expected = torch.zeros(layout.input_dim, dtype=torch.float64)
        expected[3 + canary] = -2.5 * 0.7
        torch.testing.assert_close(model.weight.grad[0], expected)
    background = data.tensors[0][3:]
    assert torch.all(background[:, 3:] == 0) and torch.all(background.norm(dim=1) > 0.7)


def test_membership_is_fair_and_the_mean_of_an_empty_batch_is_zero():
    member = draw_membership(20000, torch.Generator().manual_seed(1))
    assert abs(member.double().mean().item() - 0.5) < 0.015  # 4.2 standard deviations
    empty = torch.zeros(0, 1)
    assert CanaryLoss("mean")(empty, torch.zeros(0)).item() == 0.0


ENGINE_PATHS = [
    dict(api="modern", loss_reduction="mean"),
    dict(api="modern", loss_reduction="sum", max_physical_batch_size=7),
    dict(api="classic", accountant="rdp", loss_reduction="mean", max_physical_batch_size=16),
    dict(api="modern", grad_sample_mode="ghost"),
    dict(api="modern", grad_sample_mode="bk"),
]


@pytest.mark.parametrize("engine", ENGINE_PATHS)
def test_without_noise_each_canary_adds_exactly_its_membership(engine):
    """σ = 0, q = 1: the observation of canary i is 1 if present, 0 if absent, every step."""
    config = AuditConfig(noise_multiplier=0.0, steps=3, canaries_per_run=40, num_background=12,
                         max_grad_norm=0.5, **engine)
    record = run_with_canaries(config, report_epsilon=False)
    expected = record.membership.double().expand(3, -1)
    torch.testing.assert_close(record.observations, expected, rtol=0, atol=1e-5)
    assert sum(steps for _, _, steps in record.privacy_history) == 3


def test_poisson_observations_are_bernoulli_inclusions():
    config = AuditConfig(noise_multiplier=0.0, steps=40, sample_rate=0.25, canaries_per_run=60,
                         num_background=4)
    record = run_with_canaries(config, report_epsilon=False)
    x, member = record.observations.numpy(), record.membership.numpy()
    assert np.allclose(x[:, ~member], 0.0, atol=1e-6)
    included = x[:, member]
    assert np.allclose(included * (1 - included), 0.0, atol=1e-5)  # each entry is 0 or 1
    # inclusion frequency 0.25 over 40 · |present| ≈ 1200 draws: sd ≈ 0.0125
    assert abs(included.mean() - 0.25) < 0.05


def test_noise_on_canary_coordinates_has_the_claimed_std():
    sigma = 1.5
    config = AuditConfig(noise_multiplier=sigma, steps=5, canaries_per_run=400, num_background=8)
    record = run_with_canaries(config)
    x, member = record.observations.numpy(), record.membership.numpy()
    absent, present = x[:, ~member], x[:, member]
    # ~1000 draws per group: the sd of the std estimate is ≈ σ/√2000 ≈ 0.034
    assert absent.std() == pytest.approx(sigma, abs=0.15) and present.std() == pytest.approx(sigma, abs=0.15)
    assert abs(absent.mean()) < 0.2 and abs(present.mean() - 1.0) < 0.2
    assert record.privacy_history == [(sigma, 1.0, 5)]
    assert record.accountant_epsilon > 0


def test_runs_are_seeded_and_distinct():
    config = AuditConfig(noise_multiplier=1.0, steps=2, canaries_per_run=30, num_background=4, seed=3)
    first, again, other = (run_with_canaries(config, run, report_epsilon=False) for run in (0, 0, 1))
    torch.testing.assert_close(first.observations, again.observations)
    assert not torch.equal(first.observations, other.observations)


@pytest.mark.parametrize("bad,match", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(steps=0), "steps"),
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(api="classic"), "accountant='rdp'"),
    (dict(api="classic", accountant="rdp", grad_sample_mode="ghost"), "grad_sample_mode"),
    (dict(canary_gradient_scale=0.5), "gradient_scale"),
    (dict(confidence=1.0), "confidence"),
    (dict(accountant="moments"), "accountant"),
])
def test_bad_configurations_are_refused_by_name(bad, match):
    arguments = dict(noise_multiplier=1.0, steps=2)
    arguments.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        AuditConfig(**arguments)
