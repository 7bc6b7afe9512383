"""Gaussian-DP (CLT) accountant against hand formulas and Opacus."""

import math
import warnings

import pytest
from scipy import special

from opacus_dp.accountants import GaussianAccountant
from opacus_dp.accountants.analysis import gdp

from .oracles import gaussian_delta, gdp_delta_mp, gdp_epsilon_mp


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_mu_poisson_by_hand():
    q, sigma, steps = 0.01, 1.2, 900
    assert gdp.compute_mu_poisson(steps=steps, noise_multiplier=sigma, sample_rate=q) == pytest.approx(
        q * math.sqrt(steps * (math.exp(1 / sigma**2) - 1)), rel=1e-14
    )


def test_mu_uniform_by_hand():
    q, sigma, steps = 0.01, 1.2, 900
    inner = math.exp(sigma**-2) * special.ndtr(1.5 / sigma) + 3 * special.ndtr(-0.5 / sigma) - 2
    assert gdp.compute_mu_uniform(steps=steps, noise_multiplier=sigma, sample_rate=q) == pytest.approx(
        math.sqrt(2) * q * math.sqrt(steps * inner), rel=1e-14
    )


@pytest.mark.parametrize("mu,delta", [(0.5, 1e-5), (1.0, 1e-5), (3.0, 1e-8), (0.05, 1e-2)])
def test_epsilon_solves_the_mu_gdp_tradeoff(mu, delta):
    eps = gdp.eps_from_mu(mu=mu, delta=delta)
    assert gaussian_delta(eps, mu) == pytest.approx(delta, rel=1e-6)


def test_tiny_mu_gives_zero_epsilon():
    assert gdp.eps_from_mu(mu=1e-9, delta=1e-5) == 0.0


@pytest.mark.parametrize("sigma,q,steps", [(1.1, 256 / 60000, 14063), (0.8, 0.02, 500), (2.0, 0.1, 100)])
def test_equals_opacus_gdp(sigma, q, steps):
    from opacus.accountants import GaussianAccountant as OpacusGDP

    theirs = OpacusGDP()
    theirs.history = [(sigma, q, steps)]
    ours = GaussianAccountant()
    ours.history = [(sigma, q, steps)]
    for poisson in (True, False):
        assert ours.get_epsilon(1e-5, poisson=poisson) == pytest.approx(
            theirs.get_epsilon(1e-5, poisson=poisson), rel=1e-6
        )


def test_mixed_segments_compose_as_sum_of_squared_mu():
    accountant = GaussianAccountant()
    accountant.history = [(1.0, 0.01, 400), (2.0, 0.02, 100)]
    mu = math.sqrt(0.01**2 * 400 * math.expm1(1.0) + 0.02**2 * 100 * math.expm1(0.25))
    assert accountant.get_mu() == pytest.approx(mu, rel=1e-12)
    assert accountant.get_epsilon(1e-5) == pytest.approx(gdp.eps_from_mu(mu=mu, delta=1e-5), rel=1e-12)


@pytest.mark.parametrize("history", [[(0.1, 1.0, 1)], [(0.05, 0.01, 10)], [(0.2, 0.5, 100)]])
def test_small_sigma_gives_the_huge_epsilon_of_multiprecision_arithmetic(history):
    """σ ≤ 0.1 makes μ = q·sqrt(T(e^{1/σ²} − 1)) astronomically large; e^ε used to overflow."""
    accountant = GaussianAccountant()
    accountant.history = history
    mu = accountant.get_mu()
    assert accountant.get_epsilon(1e-5) == pytest.approx(gdp_epsilon_mp(mu, 1e-5), rel=1e-9)


@pytest.mark.parametrize("mu", [1e-3, 0.5, 3.0, 40.0, 1e3, 1e6])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0, 2.0])
def test_delta_of_mu_gdp_matches_multiprecision_for_every_scale(mu, ratio):
    """δ(ε) at ε = ratio·μ² + 1 (from δ ≈ 1/2 down to far tails) against the direct formula."""
    eps = ratio * mu * mu + 1.0
    expected = float(gdp_delta_mp(eps, mu))
    if expected > 1e-290:
        assert gdp.delta_eps_mu(eps=eps, mu=mu) == pytest.approx(expected, rel=1e-9)
