r"""Rényi DP of the sampled Gaussian mechanism and its conversion to (ε, δ)-DP.

Sampled Gaussian mechanism (SGM): each record joins the batch independently with
probability ``q`` and Gaussian noise of std ``σ`` (in units of the L2 sensitivity) is added
to the sum.  Following Mironov, Talwar & Zhang (2019), "Rényi Differential Privacy of the
Sampled Gaussian Mechanism", arXiv:1908.10530, Sec. 3.3, its RDP at order α is

.. math::  \varepsilon_{RDP}(\alpha) = \frac{\log A_\alpha}{\alpha - 1}

* integer α:  :math:`A_\alpha = \mathbb{E}_{k\sim\mathrm{Bin}(\alpha, q)}
  \exp\big(\tfrac{k^2 - k}{2\sigma^2}\big)`; we sum
  :math:`A_\alpha - 1 = \sum_{k \ge 2} P(k)\,\mathrm{expm1}\big(\tfrac{k^2-k}{2\sigma^2}\big)`
  (all terms ≥ 0, no cancellation);
* fractional α: the two-sided series of Sec. 3.3 with :math:`z_0 = \sigma^2\log(1/q - 1) + 1/2`.

RDP composes additively over steps.  The conversion to (ε, δ)-DP uses the improved bound of
Balle, Barthe, Gaboardi, Hsu & Sato (2020), "Hypothesis Testing Interpretations and Rényi
Differential Privacy", AISTATS, Theorem 21:

.. math::  \varepsilon = \min_\alpha \; \varepsilon_{RDP}(\alpha) + \log\frac{\alpha-1}{\alpha}
           - \frac{\log\delta + \log\alpha}{\alpha - 1},

clipped at 0 and set to 0 when :math:`1 - e^{-\varepsilon_{RDP}(\alpha)} \le \delta^2`
(then TV ≤ δ by the Bretagnolle–Huber inequality, as KL ≤ D_α).  The classic bound of
Mironov (2017), "Rényi Differential Privacy", Prop. 3, :math:`\varepsilon = \min_\alpha
\varepsilon_{RDP}(\alpha) - \log\delta/(\alpha-1)`, is available as ``conversion="classic"``
to reproduce older published numbers; it is never smaller than the improved one.
"""

import math
import warnings
from typing import Sequence, Tuple, Union

import numpy as np
from scipy import special

from opacus_dp.accountants.validation import (
    check_delta,
    check_noise_multiplier,
    check_orders,
    check_sample_rate,
    check_steps,
)

DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

_SERIES_CHUNK = 64
_SERIES_CHUNK_MAX = 65_536
_SERIES_MAX_TERMS = 50_000_000
_SERIES_CUTOFF = -36.0  # stop once the last term is below e^-36 × partial sum


def _signed_logsumexp(log_values: np.ndarray, signs: np.ndarray) -> Tuple[float, float]:
    """(log|Σ s_i e^{v_i}|, sign of the sum), using log1p around the largest term for accuracy."""
    top_index = int(np.argmax(log_values))
    top = float(log_values[top_index])
    if top == -math.inf:
        return -math.inf, 1.0
    scaled = signs * np.exp(log_values - top)
    top_sign = float(signs[top_index])
    scaled[top_index] = 0.0
    rest = float(np.sum(scaled))
    relative = top_sign * rest  # Σ = top_sign · e^top · (1 + relative)
    if relative > -1.0:
        return top + math.log1p(relative), top_sign
    total = top_sign * (1.0 + relative)
    if total == 0.0:
        return -math.inf, 1.0
    return top + math.log(abs(total)), math.copysign(1.0, total)


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0, accurate for small and large x."""
    x = np.asarray(x, dtype=float)
    small = x < 30.0
    safe_small = np.where(small, x, 1.0)
    return np.where(small, np.log(np.expm1(safe_small)), x + np.log1p(-np.exp(-x)))


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_α for integer α ≥ 2 via A_α − 1 = Σ_{k≥2} Bin(k; α, q)·expm1((k²−k)/(2σ²))."""
    k = np.arange(2, alpha + 1, dtype=float)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    log_pmf = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q)
    log_terms = log_pmf + _log_expm1((k * k - k) / (2 * sigma**2))
    log_a_minus_one, _ = _signed_logsumexp(log_terms, np.ones_like(log_terms))
    return float(np.logaddexp(0.0, log_a_minus_one))


def _series_terms(q: float, sigma: float, alpha: float, k: np.ndarray, log_abs_binom):
    """Log-magnitudes of both halves of the fractional-order series for indices ``k``."""
    z0 = sigma**2 * (math.log1p(-q) - math.log(q)) + 0.5
    j = alpha - k
    log_t0 = log_abs_binom + k * math.log(q) + j * math.log1p(-q) + (k * k - k) / (2 * sigma**2)
    log_t1 = log_abs_binom + j * math.log(q) + k * math.log1p(-q) + (j * j - j) / (2 * sigma**2)
    log_t0 = log_t0 + special.log_ndtr((z0 - k) / sigma)
    log_t1 = log_t1 + special.log_ndtr((j - z0) / sigma)
    return log_t0, log_t1


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_α for fractional α: signed series of Mironov, Talwar & Zhang (2019), Sec. 3.3.

    For k > α the binomial coefficients alternate in sign and the terms shrink, so the
    truncation error is below the last term kept; we stop once that term is < e^-36 ≤ A_α·e^-36.
    """
    log_total, sign_total = -math.inf, 1.0
    log_abs_binom_prev, sign_prev, start, size = 0.0, 1.0, 0, _SERIES_CHUNK
    while start < _SERIES_MAX_TERMS:
        k = np.arange(start, start + size, dtype=float)
        factors = (alpha - k) / (k + 1)  # binom(α, k+1) = binom(α, k)·(α−k)/(k+1)
        steps = np.concatenate(([0.0], np.cumsum(np.log(np.abs(factors[:-1])))))
        log_abs_binom = log_abs_binom_prev + steps
        sign = sign_prev * np.concatenate(([1.0], np.cumprod(np.sign(factors[:-1]))))
        log_t0, log_t1 = _series_terms(q, sigma, alpha, k, log_abs_binom)
        chunk, chunk_sign = _signed_logsumexp(np.concatenate((log_t0, log_t1)), np.concatenate((sign, sign)))
        log_total, sign_total = _signed_logsumexp(
            np.array([log_total, chunk]), np.array([sign_total, chunk_sign])
        )
        start += size
        size = min(2 * size, _SERIES_CHUNK_MAX)
        log_abs_binom_prev = log_abs_binom[-1] + math.log(abs(factors[-1]))
        sign_prev = sign[-1] * np.sign(factors[-1])
        last = max(log_t0[-1], log_t1[-1])
        if start > alpha + 1 and last < log_total + _SERIES_CUTOFF:
            return float(log_total)
    raise RuntimeError(f"RDP series did not converge for q={q}, sigma={sigma}, alpha={alpha}")


def _rdp_one_step(q: float, sigma: float, alpha: float) -> float:
    r"""RDP of one SGM step at order ``alpha`` (may be ``inf``), never below its true value.

    For ``0 < q`` and finite σ the true value is > 0 (the two distributions differ) and at most
    the full-batch Gaussian's :math:`\alpha / (2\sigma^2)` (:math:`A_\alpha` grows with q,
    Mironov et al. 2019). For tiny q and huge σ, :math:`\log A_\alpha` is of order
    :math:`\alpha q^2/(2\sigma^2)` (e.g. 7.5·10⁻²¹) and the signed log-sum-exp of the series can
    round it to zero or below (−1.7·10⁻²⁰). Such a value is replaced by the Gaussian bound: 0 would
    read as "identical distributions" (ε = 0 at any δ) although (0, δ)-DP fails for δ below the
    total variation distance.
    """
    if q == 0.0:
        return 0.0
    if sigma == 0.0 or math.isinf(alpha):
        return math.inf
    gaussian = alpha / (2 * sigma**2)
    if q == 1.0:
        return gaussian
    if float(alpha).is_integer():
        log_a = _log_a_integer(q, sigma, int(alpha))
    else:
        log_a = _log_a_fractional(q, sigma, alpha)
    value = log_a / (alpha - 1)
    return value if value > 0 else gaussian


def compute_rdp(
    q: float, noise_multiplier: float, steps: int, orders: Union[Sequence[float], float]
) -> Union[np.ndarray, float]:
    """RDP of ``steps`` compositions of the SGM with sample rate ``q`` and noise ``σ``.

    Returns an array aligned with ``orders`` (a float when ``orders`` is a scalar).
    """
    q = check_sample_rate(q, "q")
    sigma = check_noise_multiplier(noise_multiplier)
    steps = check_steps(steps)
    alphas = check_orders(orders, "orders")
    if steps == 0:
        rdp = np.zeros(len(alphas))
    else:
        rdp = np.array([_rdp_one_step(q, sigma, a) for a in alphas]) * steps
    return float(rdp[0]) if np.ndim(orders) == 0 else rdp


def _epsilons_per_order(alphas: np.ndarray, rdp: np.ndarray, delta: float, conversion: str):
    """ε(α) for every order under the chosen RDP → (ε, δ) conversion (``inf`` where unusable)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if conversion == "improved":
            eps = rdp + np.log1p(-1 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1)
            eps = np.where(-np.expm1(-rdp) <= delta**2, 0.0, eps)
        elif conversion == "classic":
            eps = rdp - math.log(delta) / (alphas - 1)
        else:
            raise ValueError(f"conversion must be 'improved' or 'classic', got {conversion!r}")
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.where(rdp == 0, 0.0, eps)


def get_privacy_spent(
    orders: Union[Sequence[float], float],
    rdp: Union[Sequence[float], float],
    delta: float,
    conversion: str = "improved",
) -> Tuple[float, float]:
    """Smallest ε over ``orders`` such that the RDP curve ``rdp`` implies (ε, δ)-DP.

    Returns ``(epsilon, best_order)``; ``(inf, nan)`` when no order gives a finite ε.
    ``conversion`` selects Balle et al. (2020) Thm 21 (``"improved"``, default) or
    Mironov (2017) Prop. 3 (``"classic"``).
    """
    alphas = np.asarray(check_orders(orders, "orders"), dtype=float)
    rdp_vec = np.atleast_1d(np.asarray(rdp, dtype=float))
    delta = check_delta(delta)
    if rdp_vec.shape != alphas.shape:
        raise ValueError(f"orders and rdp must have the same length, got {alphas.size} and {rdp_vec.size}")
    if np.any(rdp_vec < 0) or np.any(np.isnan(rdp_vec)):
        raise ValueError("rdp must contain values >= 0 (RDP of a mechanism is never negative)")
    eps = _epsilons_per_order(alphas, rdp_vec, delta, conversion)
    best = int(np.argmin(eps))
    if math.isinf(eps[best]):
        return math.inf, math.nan
    if eps[best] > 0 and alphas.size > 1 and alphas[best] in (alphas.min(), alphas.max()):
        side = "smallest" if alphas[best] == alphas.min() else "largest"
        warnings.warn(
            f"The optimal RDP order is the {side} one ({alphas[best]}); extend the orders "
            "(alphas) beyond it for a tighter epsilon.",
            stacklevel=2,
        )
    return max(0.0, float(eps[best])), float(alphas[best])
