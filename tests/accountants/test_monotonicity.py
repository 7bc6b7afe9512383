"""ε grows with the number of steps and with q, and falls with σ, for every accountant."""

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.accountants import create_accountant

SLACK = 1e-9  # relative floating-point slack


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def epsilon(name, sigma, q, steps, delta=1e-5):
    accountant = create_accountant(name)
    accountant.history = [(sigma, q, steps)]
    return accountant.get_epsilon(delta)


def assert_ordered(smaller, larger):
    assert smaller <= larger * (1 + SLACK) + 1e-12


settings_fast = settings(max_examples=8, deadline=None)
sigmas = st.floats(0.7, 4.0)
rates = st.floats(0.005, 0.3)
steps = st.integers(1, 300)


@pytest.mark.parametrize("name", ["rdp", "prv", "gdp"])
@settings_fast
@given(sigma=sigmas, q=rates, t=steps, extra=st.integers(1, 300))
def test_more_steps_cost_more(name, sigma, q, t, extra):
    assert_ordered(epsilon(name, sigma, q, t), epsilon(name, sigma, q, t + extra))


@pytest.mark.parametrize("name", ["rdp", "prv", "gdp"])
@settings_fast
@given(sigma=sigmas, q=rates, factor=st.floats(1.05, 3.0), t=steps)
def test_higher_sample_rate_costs_more(name, sigma, q, factor, t):
    assert_ordered(epsilon(name, sigma, q, t), epsilon(name, sigma, min(1.0, q * factor), t))


@pytest.mark.parametrize("name", ["rdp", "prv", "gdp"])
@settings_fast
@given(sigma=sigmas, q=rates, factor=st.floats(1.05, 3.0), t=steps)
def test_more_noise_costs_less(name, sigma, q, factor, t):
    assert_ordered(epsilon(name, sigma * factor, q, t), epsilon(name, sigma, q, t))


@pytest.mark.parametrize("name", ["rdp", "prv"])
@settings(max_examples=6, deadline=None)
@given(sigma=sigmas, q=rates, t=steps)
def test_smaller_delta_costs_more(name, sigma, q, t):
    assert_ordered(epsilon(name, sigma, q, t, delta=1e-4), epsilon(name, sigma, q, t, delta=1e-7))
