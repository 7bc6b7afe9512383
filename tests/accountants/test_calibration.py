"""Noise calibration: never above the target ε, and within 1 % below it."""

import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.accountants import RDPAccountant, create_accountant, get_noise_multiplier, register_accountant
from opacus_dp.accountants.utils import get_noise_multiplier as compat_get_noise_multiplier


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def epsilon_of(accountant, sigma, q, steps, delta, **options):
    acc = create_accountant(accountant)
    acc.history = [(sigma, q, steps)]
    return acc.get_epsilon(delta, **options)


@settings(max_examples=8, deadline=None)
@given(
    target=st.floats(0.3, 12.0),
    q=st.floats(0.001, 0.2),
    steps=st.integers(10, 2000),
    delta=st.sampled_from([1e-4, 1e-5, 1e-6]),
)
def test_rdp_calibration_is_at_most_target_and_within_one_percent(target, q, steps, delta):
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps, accountant="rdp")
    eps = epsilon_of("rdp", sigma, q, steps, delta)
    assert eps <= target
    assert eps >= target - 0.01 * min(1.0, target)


@pytest.mark.parametrize("target,q,epochs", [(2.0, 256 / 60000, 60), (8.0, 0.04, 90), (0.5, 0.01, 5)])
def test_prv_calibration_is_at_most_target_and_within_one_percent(target, q, epochs):
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=q, epochs=epochs,
                                 accountant="prv")
    eps = epsilon_of("prv", sigma, q, int(epochs / q), 1e-5)
    assert 0.99 * target <= eps <= target


def test_gdp_calibration_and_rdp_orders_are_forwarded():
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=1000, accountant="gdp")
    assert 2.97 <= epsilon_of("gdp", sigma, 0.01, 1000, 1e-5) <= 3.0
    orders = [2, 4, 8, 16, 32, 64]
    sigma = get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=1000, accountant="rdp", alphas=orders
    )
    assert 2.97 <= epsilon_of("rdp", sigma, 0.01, 1000, 1e-5, alphas=orders) <= 3.0


def test_epochs_become_ceil_epochs_over_sample_rate():
    # 7 / 0.03 = 233.33...: the run takes 234 steps, never fewer
    by_epochs = get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.03, epochs=7, accountant="rdp")
    by_steps = get_noise_multiplier(
        target_epsilon=1.0, target_delta=1e-5, sample_rate=0.03, steps=234, accountant="rdp"
    )
    assert by_epochs == by_steps


def test_compat_path_is_the_same_function():
    assert compat_get_noise_multiplier is get_noise_multiplier


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target_epsilon=0.0), "target_epsilon"),
        (dict(target_epsilon=-1.0), "target_epsilon"),
        (dict(target_epsilon=math.inf), "target_epsilon"),
        (dict(target_epsilon=math.nan), "target_epsilon"),
        (dict(target_delta=0.0), "target_delta"),
        (dict(target_delta=1.0), "target_delta"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(steps=None), "exactly one of epochs or steps"),
        (dict(epochs=3), "exactly one of epochs or steps"),
        (dict(accountant="moments"), "unknown accountant"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(kwargs, message):
    arguments = dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=100, accountant="rdp")
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        get_noise_multiplier(**arguments)


def test_unreachable_budget_is_refused():
    class NeverPrivate(RDPAccountant):
        @classmethod
        def mechanism(cls):
            return "never-private-test"

        def get_epsilon(self, delta):
            return math.inf

    register_accountant("never-private-test", NeverPrivate, force=True)
    with pytest.raises(ValueError, match="too small"):
        get_noise_multiplier(
            target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=10, accountant="never-private-test"
        )


def test_default_accountant_is_rdp_as_in_opacus():
    """An Opacus script that calibrates without naming the accountant and then accounts with
    RDP must stay within its budget: the default is RDP (Opacus 1.6's σ to its tolerance)."""
    from opacus.accountants.utils import get_noise_multiplier as opacus_get_noise_multiplier

    args = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, epochs=10)
    sigma = get_noise_multiplier(**args)
    assert sigma == get_noise_multiplier(**args, accountant="rdp")
    assert sigma == pytest.approx(opacus_get_noise_multiplier(**args), rel=0.02)
    accountant = RDPAccountant()
    accountant.history = [(sigma, 0.01, 1000)]
    assert accountant.get_epsilon(1e-5) <= 3.0
