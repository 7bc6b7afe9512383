"""RDP of the sampled Gaussian mechanism and the RDP → (ε, δ) conversion."""

import math
import warnings

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp

from opacus_dp.accountants.analysis.rdp import DEFAULT_ALPHAS, compute_rdp, get_privacy_spent

from .oracles import dp_accounting_rdp_epsilon, rdp_by_integration

STANDARD = [(256 / 60000, 1.1), (0.01, 0.8), (0.05, 2.0), (0.2, 5.0), (1e-3, 1.0)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("q,sigma", STANDARD)
def test_rdp_equals_opacus_on_default_orders(q, sigma):
    ours = compute_rdp(q, sigma, 1000, DEFAULT_ALPHAS)
    reference = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1000, orders=DEFAULT_ALPHAS)
    np.testing.assert_allclose(ours, reference, rtol=1e-6)


@pytest.mark.parametrize(
    "q,sigma,alpha",
    [(0.01, 1.0, 2), (0.01, 1.0, 2.5), (0.1, 0.7, 1.1), (1e-5, 5.0, 1.1), (0.5, 20.0, 256.5), (0.004, 1.1, 33)],
)
def test_rdp_matches_numerical_integral(q, sigma, alpha):
    """Integer and fractional orders against a 40-digit quadrature of A_α."""
    expected = rdp_by_integration(q, sigma, alpha)
    assert compute_rdp(q, sigma, 1, alpha) == pytest.approx(expected, rel=1e-6)


def test_rdp_special_cases():
    orders = [1.5, 2, 10]
    assert np.all(compute_rdp(0.0, 1.0, 100, orders) == 0)
    assert np.all(np.isinf(compute_rdp(0.1, 0.0, 100, orders)))
    np.testing.assert_allclose(compute_rdp(1.0, 2.0, 3, orders), 3 * np.array(orders) / (2 * 2.0**2))
    assert np.all(compute_rdp(0.1, 1.0, 0, orders) == 0)
    assert isinstance(compute_rdp(0.1, 1.0, 1, 2.0), float)


def test_improved_conversion_formula_by_hand():
    orders = np.array([2.0, 8.0, 32.0])
    rdp = np.array([0.3, 1.0, 4.0])
    delta = 1e-5
    by_hand = rdp + np.log((orders - 1) / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    eps, order = get_privacy_spent(orders, rdp, delta)
    assert eps == pytest.approx(by_hand.min(), rel=1e-12)
    assert order == orders[np.argmin(by_hand)]


def test_classic_conversion_formula_by_hand_and_never_smaller():
    orders = np.array(DEFAULT_ALPHAS)
    rdp = compute_rdp(150 / 60000, 1.3, 6000, DEFAULT_ALPHAS)
    classic, _ = get_privacy_spent(orders, rdp, 1e-5, conversion="classic")
    improved, _ = get_privacy_spent(orders, rdp, 1e-5)
    assert classic == pytest.approx(np.min(rdp - math.log(1e-5) / (orders - 1)), rel=1e-12)
    assert improved <= classic


def test_published_mnist_value():
    """q = 150/60000, σ = 1.3, 6000 steps, δ = 1e-5 with the default orders: ε = 0.7242."""
    rdp = compute_rdp(150 / 60000, 1.3, 6000, DEFAULT_ALPHAS)
    eps, order = get_privacy_spent(DEFAULT_ALPHAS, rdp, 1e-5)
    assert round(eps, 4) == 0.7242
    assert order == 19


INTEGER_ORDERS = list(range(2, 257))


@pytest.mark.parametrize("q,sigma", STANDARD)
def test_rdp_and_conversion_equal_dp_accounting_on_integer_orders(q, sigma):
    """dp-accounting bounds fractional orders from above by interpolation, so only integer
    orders (exact in both) are compared."""
    rdp = compute_rdp(q, sigma, 2000, INTEGER_ORDERS)
    eps, _ = get_privacy_spent(INTEGER_ORDERS, rdp, 1e-6)
    assert eps == pytest.approx(dp_accounting_rdp_epsilon([(sigma, q, 2000)], 1e-6, INTEGER_ORDERS), rel=1e-6)


def test_no_privacy_cost_gives_zero_and_no_privacy_gives_infinity():
    assert get_privacy_spent([2, 4], [0.0, 0.0], 1e-5) == (0.0, 2.0)
    eps, order = get_privacy_spent([2, 4], [math.inf, math.inf], 1e-5)
    assert math.isinf(eps) and math.isnan(order)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="orders and rdp"):
        get_privacy_spent([2, 3], [0.1], 1e-5)
    with pytest.raises(ValueError, match="delta"):
        get_privacy_spent([2], [0.1], 0.0)
    with pytest.raises(ValueError, match="conversion"):
        get_privacy_spent([2], [0.1], 1e-5, conversion="tight")
    with pytest.raises(ValueError, match="noise_multiplier"):
        compute_rdp(0.1, -1.0, 1, [2])
    with pytest.raises(ValueError, match="q"):
        compute_rdp(1.5, 1.0, 1, [2])
    with pytest.raises(ValueError, match="orders"):
        compute_rdp(0.1, 1.0, 1, [1.0])


@pytest.mark.parametrize("q,sigma", [(1e-5, 1e5), (3e-5, 1e6), (1e-3, 1e6)])
def test_rdp_of_a_negligible_step_is_never_negative(q, sigma):
    """RDP > 0 always for q > 0 (the distributions differ); for tiny q and huge σ the
    fractional-order series used to round to about −1e-20 at some orders. Every value is now at
    least the 40-digit quadrature's and at most the full-batch Gaussian's α / (2σ²)."""
    rdp = compute_rdp(q, sigma, 1, DEFAULT_ALPHAS)
    alphas = np.array(DEFAULT_ALPHAS)
    assert np.all(rdp > 0) and np.all(rdp <= alphas / (2 * sigma**2) * (1 + 1e-12))
    assert rdp[DEFAULT_ALPHAS.index(1.5)] >= rdp_by_integration(q, sigma, 1.5) - 1e-30


def test_negligible_loss_is_not_reported_as_no_loss():
    """q = 1e-8, σ = 1e4, one step: (0, δ)-DP holds only for δ ≥ TV = q (2Φ(1/(2σ)) − 1) ≈ 4e-13;
    below it ε must be > 0 (a rounded RDP of 0 read as identical distributions gave ε = 0)."""
    from scipy.stats import norm

    q, sigma = 1e-8, 1e4
    total_variation = q * (2 * norm.cdf(1 / (2 * sigma)) - 1)
    rdp = compute_rdp(q, sigma, 1, DEFAULT_ALPHAS)
    for delta in (total_variation / 10, total_variation / 1000):
        assert get_privacy_spent(DEFAULT_ALPHAS, rdp, delta)[0] > 0


def test_rdp_accountant_with_a_negligible_privacy_loss_matches_dp_accounting():
    from opacus_dp.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(1e5, 1e-5, 100)]
    expected = dp_accounting_rdp_epsilon([(1e5, 1e-5, 100)], 1e-5, DEFAULT_ALPHAS)
    assert accountant.get_epsilon(1e-5) == pytest.approx(expected, abs=1e-12)
