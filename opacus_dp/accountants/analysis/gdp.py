r"""Gaussian differential privacy (μ-GDP) of DP-SGD via the central limit theorem.

Dong, Roth & Su (2022), "Gaussian Differential Privacy", JRSS-B, Thm 3.5/Cor. 5.4, and Bu,
Dong, Long & Su (2020), "Deep Learning with Gaussian Differential Privacy", HDSR: T steps of
the subsampled Gaussian mechanism are *asymptotically* μ-GDP with

* Poisson sampling:  :math:`\mu = q\sqrt{T\,(e^{1/\sigma^2} - 1)}`,
* uniform sampling without replacement:
  :math:`\mu = \sqrt{2}\,q\sqrt{T\,(e^{1/\sigma^2}\Phi(1.5/\sigma) + 3\Phi(-0.5/\sigma) - 2)}`.

Segments compose as :math:`\mu^2 = \sum_s \mu_s^2`.  A μ-GDP mechanism is (ε, δ(ε))-DP with
:math:`\delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2) - e^{\varepsilon}\Phi(-\varepsilon/\mu - \mu/2)`
(Dong, Roth & Su, Cor. 2.13).  This is a limit theorem, **not** a guaranteed upper bound:
for finite T it can under-report ε (Gopi et al. 2021).
"""

import math

from scipy import optimize, special

from opacus_dp.accountants.validation import check_delta, check_noise_multiplier, check_sample_rate, check_steps


def compute_mu_poisson(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
    """CLT μ of ``steps`` Poisson-subsampled Gaussian steps."""
    sigma = check_noise_multiplier(noise_multiplier)
    q, steps = check_sample_rate(sample_rate), check_steps(steps)
    if q == 0 or steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return q * math.sqrt(steps * math.expm1(sigma**-2)) if sigma**-2 < 700 else math.inf


def compute_mu_uniform(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
    """CLT μ of ``steps`` Gaussian steps on uniformly sampled fixed-size batches."""
    sigma = check_noise_multiplier(noise_multiplier)
    q, steps = check_sample_rate(sample_rate), check_steps(steps)
    if q == 0 or steps == 0:
        return 0.0
    if sigma == 0 or sigma**-2 >= 700:
        return math.inf
    inner = math.exp(sigma**-2) * special.ndtr(1.5 / sigma) + 3 * special.ndtr(-0.5 / sigma) - 2
    return math.sqrt(2) * q * math.sqrt(steps * inner)


def _log_mills_ratio(x: float) -> float:
    """log R(x) of the Mills ratio R(x) = Φ(−x)/φ(x) = √(π/2)·erfcx(x/√2), for any real x."""
    if x > -20.0:  # erfcx(x/√2) is finite and accurate here
        return math.log(special.erfcx(x / math.sqrt(2))) + 0.5 * math.log(math.pi / 2)
    return float(special.log_ndtr(-x)) + 0.5 * x * x + 0.5 * math.log(2 * math.pi)


def delta_eps_mu(*, eps: float, mu: float) -> float:
    r"""δ(ε) of μ-GDP: Φ(a) − e^ε Φ(b) with a = −ε/μ + μ/2, b = a − μ.

    Since :math:`b^2 - a^2 = 2\varepsilon`, :math:`e^\varepsilon\varphi(b) = \varphi(a)`, so with
    the Mills ratio R(x) = Φ(−x)/φ(x) (decreasing, so the bracket is ≥ 0)

    .. math::  \delta(\varepsilon) = \Phi(a)\,\big(1 - R(-b)/R(-a)\big)
               = -\Phi(a)\,\mathrm{expm1}\big(\log R(-b) - \log R(-a)\big).

    This form never overflows and never subtracts two huge numbers; the direct form overflows
    in ``e^ε`` (or cancels ``ε`` against ``log Φ(b)``) once μ is of order 10 or more.
    """
    if mu == 0:
        return 0.0
    ratio = _log_mills_ratio(eps / mu + mu / 2) - _log_mills_ratio(eps / mu - mu / 2)
    return max(0.0, float(special.ndtr(-eps / mu + mu / 2)) * -math.expm1(min(ratio, 0.0)))


def eps_from_mu(*, mu: float, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ δ for a μ-GDP mechanism (``inf`` when no finite float ε
    bounds it, i.e. μ so large that the search passes the largest float)."""
    delta = check_delta(delta)
    if math.isinf(mu):
        return math.inf
    if delta_eps_mu(eps=0.0, mu=mu) <= delta:
        return 0.0
    high = max(1.0, mu * mu)
    while math.isfinite(high) and delta_eps_mu(eps=high, mu=mu) > delta:
        high *= 2
    if not math.isfinite(high):
        return math.inf
    return float(optimize.brentq(lambda e: delta_eps_mu(eps=e, mu=mu) - delta, 0.0, high, xtol=1e-12, rtol=1e-12))


def compute_eps_poisson(*, steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """CLT ε of Poisson-subsampled DP-SGD."""
    mu = compute_mu_poisson(steps=steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return eps_from_mu(mu=mu, delta=delta)


def compute_eps_uniform(*, steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """CLT ε of DP-SGD with uniformly sampled fixed-size batches."""
    mu = compute_mu_uniform(steps=steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return eps_from_mu(mu=mu, delta=delta)
