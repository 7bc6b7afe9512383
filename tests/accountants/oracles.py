"""Independent oracles for the accountant tests (reference libraries and closed forms)."""

import logging
import math

import mpmath
from scipy import optimize, special

import dp_accounting
from dp_accounting import pld, rdp

logging.getLogger().setLevel(logging.ERROR)  # dp-accounting logs a warning per optimistic PLD


def pld_epsilon(segments, delta, grid=1e-4):
    """dp-accounting PLD ε (pessimistic, connect-the-dots) of composed (σ, q, steps) segments."""
    accountant = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=grid)
    for sigma, q, steps in segments:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def pld_optimistic_epsilon(sigma, q, steps, delta, grid=1e-4):
    """dp-accounting's optimistic (lower) PLD estimate of ε."""
    from dp_accounting.pld import privacy_loss_distribution as pldm

    dist = pldm.from_gaussian_mechanism(
        sigma, sampling_prob=q, pessimistic_estimate=False, value_discretization_interval=grid, use_connect_dots=False
    )
    return dist.self_compose(steps).get_epsilon_for_delta(delta)


def dp_accounting_rdp_epsilon(segments, delta, orders):
    """dp-accounting RDP accountant ε of composed (σ, q, steps) segments."""
    accountant = rdp.RdpAccountant(orders=list(orders))
    for sigma, q, steps in segments:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def rdp_by_integration(q, sigma, alpha, dps=40):
    """RDP of one sampled Gaussian step: log E_{x~N(0,σ²)}[((1−q) + q e^{(2x−1)/(2σ²)})^α]/(α−1)."""
    mpmath.mp.dps = dps
    q, sigma, alpha = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(alpha)

    def integrand(x):
        return mpmath.npdf(x, 0, sigma) * ((1 - q) + q * mpmath.exp((2 * x - 1) / (2 * sigma**2))) ** alpha

    points = [-mpmath.inf, -12 * sigma, 0, 0.5, 1, 12 * sigma + alpha * sigma, mpmath.inf]
    return float(mpmath.log(mpmath.quad(integrand, points)) / (alpha - 1))


def gaussian_delta(epsilon, mu):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang 2018)."""
    return special.ndtr(-epsilon / mu + mu / 2) - math.exp(epsilon + special.log_ndtr(-epsilon / mu - mu / 2))


def gaussian_epsilon(mu, delta):
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, 10 * mu * mu + 50, xtol=1e-13)


def subsampled_gaussian_delta(epsilon, sigma, q, direction):
    """Exact δ(ε) of ONE Poisson-subsampled Gaussian step, one direction of add/remove.

    remove: H_{e^ε}(M || A) with M = (1−q)N(0,σ²) + qN(1,σ²), A = N(0,σ²);
    add:    H_{e^ε}(A || M).  Both are integrals over a half-line of x, where the
    likelihood ratio crosses e^ε.
    """
    alpha = math.exp(epsilon)

    def cdf(x, mean):
        return special.ndtr((x - mean) / sigma)

    if direction == "remove":
        if alpha <= 1 - q:
            return 1 - alpha
        x = sigma**2 * math.log((alpha - (1 - q)) / q) + 0.5
        mass_m = (1 - q) * (1 - cdf(x, 0)) + q * (1 - cdf(x, 1))
        return mass_m - alpha * (1 - cdf(x, 0))
    if 1 / alpha <= 1 - q:
        return 0.0
    x = sigma**2 * math.log((1 / alpha - (1 - q)) / q) + 0.5
    mass_m = (1 - q) * cdf(x, 0) + q * cdf(x, 1)
    return cdf(x, 0) - alpha * mass_m


def subsampled_gaussian_epsilon(sigma, q, delta):
    """Exact ε(δ) of one Poisson-subsampled Gaussian step (max over both directions)."""
    result = 0.0
    for direction in ("remove", "add"):
        f = lambda e: subsampled_gaussian_delta(e, sigma, q, direction) - delta  # noqa: E731
        if f(0.0) > 0:
            result = max(result, optimize.brentq(f, 0.0, 100.0, xtol=1e-13))
    return result


def gdp_delta_mp(epsilon, mu):
    """δ(ε) of μ-GDP, Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), by the direct formula in multiprecision
    arithmetic with 60 more digits than ε has, which absorbs the cancellation of e^ε against Φ."""
    with mpmath.workdps(60 + max(0, int(math.log10(max(epsilon, mu * mu, 1.0))))):
        e, m = mpmath.mpf(epsilon), mpmath.mpf(mu)
        return mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2)


def gdp_epsilon_mp(mu, delta):
    """ε(δ) of μ-GDP by bisection on :func:`gdp_delta_mp` (to the last float)."""
    low, high = 0.0, 1.0
    while gdp_delta_mp(high, mu) > delta:
        low, high = high, high * 2
    while True:
        mid = (low + high) / 2
        if mid in (low, high):
            return high
        low, high = (mid, high) if gdp_delta_mp(mid, mu) > delta else (low, mid)
