"""PRV accountant: an upper bound on ε, tight against dp-accounting's PLD and closed forms."""

import math
import time
from contextlib import nullcontext

import numpy as np
import pytest

from opacus_dp.accountants import PRVAccountant, RDPAccountant
from opacus_dp.accountants.analysis.prv import DiscretePLD, delta_for_epsilon, epsilon_for_delta
from opacus_dp.accountants.analysis.prv.subsampled_gaussian import subsampled_gaussian_pld

from .oracles import (
    gaussian_epsilon,
    pld_epsilon,
    pld_optimistic_epsilon,
    subsampled_gaussian_delta,
    subsampled_gaussian_epsilon,
)


def prv_epsilon(segments, delta, **options):
    accountant = PRVAccountant()
    accountant.history = list(segments)
    return accountant.get_epsilon(delta, **options)


def test_standard_setting_within_band_of_dp_accounting_pld():
    """q = 256/60000, σ = 1.1, 14063 steps, δ = 1e-5 (PLD: 2.382)."""
    segment = (1.1, 256 / 60000, 14063)
    ours = prv_epsilon([segment], 1e-5)
    reference = pld_epsilon([segment], 1e-5)
    assert 0.995 * reference <= ours <= 1.003 * reference


@pytest.mark.parametrize("segment,delta", [((3.0, 0.2, 60), 1e-5), ((2.0, 0.001, 3000), 1e-6), ((1.5, 0.01, 500), 1e-5)])
def test_other_settings_within_band_of_dp_accounting_pld(segment, delta):
    ours = prv_epsilon([segment], delta)
    reference = pld_epsilon([segment], delta)
    assert 0.995 * reference <= ours <= 1.003 * reference


def test_never_below_the_optimistic_pld_estimate():
    segment = (2.0, 0.01, 400)
    assert prv_epsilon([segment], 1e-6) >= pld_optimistic_epsilon(*segment, 1e-6)


@pytest.mark.parametrize("sigma,q,delta", [(1.0, 0.01, 1e-5), (0.5, 0.3, 1e-6), (2.0, 1.0, 1e-5), (0.7, 0.05, 1e-3)])
def test_one_step_is_an_upper_bound_close_to_the_exact_value(sigma, q, delta):
    exact = subsampled_gaussian_epsilon(sigma, q, delta)
    ours = prv_epsilon([(sigma, q, 1)], delta)
    assert exact <= ours <= exact + 1e-4  # grid step 1e-4


@pytest.mark.parametrize("sigma,steps", [(1.0, 100), (3.0, 7), (10.0, 1000)])
def test_full_batch_composition_equals_the_gaussian_mechanism(sigma, steps):
    """q = 1: T steps of N(0, σ²) noise are one Gaussian mechanism with μ = √T/σ (exact)."""
    exact = gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    ours = prv_epsilon([(sigma, 1.0, steps)], 1e-5)
    assert exact <= ours <= exact * (1 + 1e-4) + 1e-6


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_discretised_step_dominates_exact_delta_and_matches_on_grid(direction):
    sigma, q, h = 0.9, 0.05, 1e-3
    pld = subsampled_gaussian_pld(sigma, q, h, direction, 1e-14)
    assert pld.pmf.sum() + pld.infinity_mass == pytest.approx(1.0, abs=1e-12)
    for eps in [0.0, 0.0105, 0.05, 0.1234, 0.5, 1.3]:
        exact = subsampled_gaussian_delta(eps, sigma, q, direction)
        assert delta_for_epsilon(pld, eps) >= exact - 1e-15
    for eps in [0.01, 0.05, 0.123, 0.5]:  # connect-the-dots is exact at grid points
        exact = subsampled_gaussian_delta(eps, sigma, q, direction)
        assert delta_for_epsilon(pld, eps) == pytest.approx(exact, rel=1e-7, abs=1e-15)


def test_mixed_segments_match_dp_accounting_composition():
    segments = [(1.5, 0.01, 300), (2.5, 0.04, 200), (3.0, 0.005, 500)]
    ours = prv_epsilon(segments, 1e-5)
    reference = pld_epsilon(segments, 1e-5)
    assert 0.995 * reference <= ours <= 1.003 * reference
    # the order of the segments does not matter for a composition
    assert prv_epsilon(segments[::-1], 1e-5) == pytest.approx(ours, rel=1e-6)


def test_prv_is_tighter_than_rdp_on_the_standard_setting():
    rdp = RDPAccountant()
    rdp.history = [(1.1, 256 / 60000, 14063)]
    assert prv_epsilon(rdp.history, 1e-5) < rdp.get_epsilon(1e-5)


@pytest.mark.parametrize(
    "segment,delta,rdp_at_smallest_order",  # ε in the thousands: RDP's best order is its smallest
    [((0.3, 0.5, 10_000), 1e-5, True), ((1.1, 256 / 60000, 14063), 1e-12, False), ((1.0, 1.0, 50), 1e-12, False),
     ((0.05, 0.1, 10), 1e-5, True)],
)
def test_extreme_settings_give_finite_upper_bounds(segment, delta, rdp_at_smallest_order):
    eps = prv_epsilon([segment], delta)
    assert math.isfinite(eps) and eps > 0
    rdp = RDPAccountant()
    rdp.history = [segment]
    smallest = pytest.warns(UserWarning, match="optimal RDP order is the smallest")
    with smallest if rdp_at_smallest_order else nullcontext():
        assert not math.isnan(rdp.get_epsilon(delta))


def test_epsilon_for_delta_inverts_delta_for_epsilon():
    pld = DiscretePLD(grid_step=0.1, offset=-3, pmf=np.array([0.1, 0.2, 0.3, 0.2, 0.1, 0.05, 0.04]), infinity_mass=0.01)
    # by hand: δ(0) = 0.01 + Σ_{ℓ>0} p (1 − e^{−ℓ}) over the losses 0.1, 0.2, 0.3
    delta_at_zero = 0.01 + 0.1 * -math.expm1(-0.1) + 0.05 * -math.expm1(-0.2) + 0.04 * -math.expm1(-0.3)
    assert delta_for_epsilon(pld, 0.0) == pytest.approx(delta_at_zero, rel=1e-12)
    assert epsilon_for_delta(pld, delta_at_zero) == pytest.approx(0.0, abs=1e-12)
    assert epsilon_for_delta(pld, 0.5) == 0.0
    for delta in [0.03, 0.02, 0.015, 0.0101]:
        eps = epsilon_for_delta(pld, delta)
        assert 0 < eps < 0.3
        assert delta_for_epsilon(pld, eps) == pytest.approx(delta, rel=1e-9)
    assert epsilon_for_delta(pld, 0.009) == math.inf


def test_hundred_thousand_steps_is_fast():
    start = time.process_time()
    prv_epsilon([(1.1, 256 / 60000, 100_000)], 1e-5)
    prv_seconds = time.process_time() - start
    rdp = RDPAccountant()
    rdp.history = [(1.1, 256 / 60000, 100_000)]
    start = time.process_time()
    rdp.get_epsilon(1e-5)
    rdp_seconds = time.process_time() - start
    assert prv_seconds < 2.0 and rdp_seconds < 1.0


def test_eps_error_and_delta_error_are_validated():
    with pytest.raises(ValueError, match="eps_error"):
        prv_epsilon([(1.0, 0.1, 1)], 1e-5, eps_error=0)
    with pytest.raises(ValueError, match="delta_error"):
        prv_epsilon([(1.0, 0.1, 1)], 1e-5, delta_error=1e-4)


def test_tiny_delta_full_batch_matches_the_gaussian_mechanism():
    """δ = 1e-12 is beyond the plain FFT's round-off; the tilted composition must stay exact."""
    exact = gaussian_epsilon(math.sqrt(1000) / 20.0, 1e-12)
    ours = prv_epsilon([(20.0, 1.0, 1000)], 1e-12)
    assert exact <= ours <= exact * (1 + 1e-3)


def test_tiny_delta_many_steps_is_tighter_than_rdp_and_refines_from_above():
    segment, delta = (0.7, 1e-4, 10**6), 1e-10
    rdp = RDPAccountant()
    rdp.history = [segment]
    coarse = prv_epsilon([segment], delta)  # grid 1e-4
    fine = prv_epsilon([segment], delta, eps_error=0.005)  # grid 5e-5 refines the 1e-4 grid
    assert fine <= coarse * (1 + 1e-6) < rdp.get_epsilon(delta)
    assert coarse <= fine * 1.01


@pytest.mark.parametrize(
    "segment", [(1.0, 0.1, 10**18), (1.0, 0.01, 10**18), (100.0, 1e-6, 10**14), (1.0, 1.0, 3 * 10**10)]
)
def test_histories_beyond_the_grid_give_infinite_epsilon_with_a_warning(segment):
    """Step counts whose loss does not fit on a grid used to raise OverflowError or ValueError;
    ε = inf is the conservative answer (never a finite under-estimate)."""
    with pytest.warns(RuntimeWarning, match="accountant='rdp'"):
        assert prv_epsilon([segment], 1e-5) == math.inf


def test_longest_resolvable_full_batch_run_is_still_an_upper_bound():
    """10⁹ full-batch steps at σ = 1: the coarse grid stays above the exact Gaussian ε."""
    exact = gaussian_epsilon(math.sqrt(1e9), 1e-5)
    assert exact <= prv_epsilon([(1.0, 1.0, 10**9)], 1e-5) < math.inf
