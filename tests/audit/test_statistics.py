"""Clopper–Pearson limits, GDP and (ε, δ) conversions: against scipy, dp-accounting, hand values."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from opacus_dp.audit.statistics import (
    clopper_pearson_lower,
    clopper_pearson_upper,
    error_rate_upper_bounds,
    gaussian_mechanism_mu,
    gdp_epsilon,
    mu_lower_bound,
    plain_epsilon_lower_bound,
)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 400), data=st.data(), alpha=st.sampled_from([0.01, 0.025, 0.05, 0.2]))
def test_upper_limit_is_where_the_binomial_tail_equals_alpha(n, data, alpha):
    k = data.draw(st.integers(0, n - 1))
    upper = float(clopper_pearson_upper(k, n, alpha))
    assert stats.binom.cdf(k, n, upper) == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert upper > k / n


def test_upper_limit_of_all_successes_is_one_and_lower_mirrors_upper():
    assert clopper_pearson_upper(7, 7, 0.05) == 1.0
    assert clopper_pearson_lower(0, 9, 0.05) == 0.0
    # hand value: k = 0 gives 1 - α^(1/n)
    assert float(clopper_pearson_upper(0, 10, 0.05)) == pytest.approx(1 - 0.05 ** 0.1, rel=1e-9)
    assert float(clopper_pearson_lower(3, 10, 0.05)) == pytest.approx(
        1 - float(clopper_pearson_upper(7, 10, 0.05)), rel=1e-12)


def test_upper_limit_covers_the_true_rate():
    rng = np.random.default_rng(1)
    p, n, alpha = 0.3, 200, 0.05
    k = rng.binomial(n, p, size=4000)
    misses = np.mean(clopper_pearson_upper(k, n, alpha) < p)
    assert misses <= alpha  # exact method: conservative (binomial sd of the estimate ≈ 0.0034)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="successes"):
        clopper_pearson_upper(5, 4, 0.05)


@pytest.mark.parametrize("mu", [0.3, 0.9, 2.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_gdp_epsilon_matches_dp_accounting_gaussian_mechanism(mu, delta):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier=1.0 / mu))
    assert gdp_epsilon(mu, delta) == pytest.approx(accountant.get_epsilon(delta), rel=2e-3)


def test_gdp_epsilon_edge_cases():
    assert gdp_epsilon(0.0, 1e-5) == 0.0
    assert gdp_epsilon(1.0, 0.0) == math.inf
    assert gaussian_mechanism_mu(noise_multiplier=2.0, steps=9) == 1.5
    assert gaussian_mechanism_mu(noise_multiplier=0.0, steps=1) == math.inf


@pytest.mark.parametrize("threshold", [-1.0, 0.4, 2.5])
def test_exact_gaussian_rates_give_back_mu(threshold):
    mu = 1.3
    fpr, fnr = stats.norm.sf(threshold), stats.norm.cdf(threshold - mu)
    assert float(mu_lower_bound(fpr, fnr)) == pytest.approx(mu, rel=1e-9)


def test_mu_bound_is_floored_at_zero():
    assert float(mu_lower_bound(0.7, 0.6)) == 0.0


def test_plain_bound_hand_values():
    # FPR = 0.01, FNR = 0.5, δ = 0: log(0.5/0.01) vs log(0.99/0.5)
    assert float(plain_epsilon_lower_bound(0.01, 0.5, 0.0)) == pytest.approx(math.log(50.0))
    assert float(plain_epsilon_lower_bound(0.5, 0.01, 0.0)) == pytest.approx(math.log(50.0))
    assert float(plain_epsilon_lower_bound(0.5, 0.5, 0.0)) == 0.0
    assert float(plain_epsilon_lower_bound(0.0, 0.2, 1e-5)) == math.inf
    # randomized response with ε0 has FPR = FNR = 1/(1 + e^ε0): the bound is ε0 exactly
    eps0 = 1.7
    rate = 1 / (1 + math.exp(eps0))
    assert float(plain_epsilon_lower_bound(rate, rate, 0.0)) == pytest.approx(eps0)


def test_joint_limits_use_half_the_level_each():
    fpr_upper, fnr_upper = error_rate_upper_bounds(10, 100, 20, 120, confidence=0.9)
    assert float(fpr_upper) == pytest.approx(float(clopper_pearson_upper(10, 100, 0.05)))
    assert float(fnr_upper) == pytest.approx(float(clopper_pearson_upper(20, 120, 0.05)))
    with pytest.raises(ValueError, match="confidence"):
        error_rate_upper_bounds(1, 10, 1, 10, confidence=1.5)
