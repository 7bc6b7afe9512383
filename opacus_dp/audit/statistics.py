"""Confidence bounds that turn membership guesses into lower bounds on ε.

A membership test on one canary has a false-positive rate ``FPR`` (guessing "in" when the
canary was left out) and a false-negative rate ``FNR``. Every mechanism bounds the pairs it
allows:

* (ε, δ)-DP (Kairouz, Oh & Viswanath 2015, "The Composition Theorem for Differential
  Privacy"): ``FPR + e^ε·FNR ≥ 1 − δ`` and ``FNR + e^ε·FPR ≥ 1 − δ``, hence

      ε ≥ max( log((1 − δ − FNR)/FPR), log((1 − δ − FPR)/FNR) );

* μ-GDP (Dong, Roth & Su 2022, "Gaussian Differential Privacy"): ``FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ)``,
  hence ``μ ≥ Φ⁻¹(1 − FPR) − Φ⁻¹(FNR)``, and the refuted GDP claim converts to ε(δ) with
  ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)``.

The rates are only estimated, so the bounds use one-sided Clopper–Pearson upper limits
(Clopper & Pearson 1934) at level ``α/2`` each: both hold together with probability ≥ 1 − α
(union bound), and so does every bound computed from them. This is the procedure of Nasr et
al. 2023, "Tight Auditing of Differentially Private Machine Learning".
"""

import math
from typing import Tuple

import numpy as np
from scipy import special, stats

from opacus_dp.accountants.analysis.gdp import eps_from_mu


def check_confidence(confidence) -> float:
    """``confidence`` as a float in (0, 1), else ValueError naming it."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)):
        raise TypeError(f"confidence must be a float in (0, 1), e.g. 0.95, got {confidence!r}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), e.g. 0.95, got {confidence!r}")
    return float(confidence)


def check_delta(delta) -> float:
    """``delta`` as a float in [0, 1), else ValueError naming it."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 <= float(delta) < 1.0:
        raise ValueError(f"delta must be a float in [0, 1), e.g. 1e-5, got {delta!r}")
    return float(delta)


def clopper_pearson_upper(successes, trials, alpha: float) -> np.ndarray:
    """One-sided upper ``1 − α`` Clopper–Pearson limit of a binomial proportion.

    The p with ``P[Binomial(n, p) ≤ k] = α`` (the ``1 − α`` quantile of ``Beta(k + 1, n − k)``);
    1 when ``k = n``. Works elementwise on arrays.
    """
    k, n = np.broadcast_arrays(np.asarray(successes, dtype=float), np.asarray(trials, dtype=float))
    if np.any(n <= 0) or np.any(k < 0) or np.any(k > n):
        raise ValueError("clopper_pearson_upper: need 0 ≤ successes ≤ trials and trials > 0")
    upper = np.ones_like(k)
    inside = k < n
    upper[inside] = stats.beta.ppf(1.0 - alpha, k[inside] + 1.0, n[inside] - k[inside])
    return upper


def clopper_pearson_lower(successes, trials, alpha: float) -> np.ndarray:
    """One-sided lower ``1 − α`` Clopper–Pearson limit (0 when ``k = 0``)."""
    k, n = np.broadcast_arrays(np.asarray(successes, dtype=float), np.asarray(trials, dtype=float))
    return 1.0 - clopper_pearson_upper(n - k, n, alpha)


def mu_lower_bound(fpr_upper, fnr_upper) -> np.ndarray:
    """``Φ⁻¹(1 − FPR) − Φ⁻¹(FNR)``, floored at 0.

    No μ-GDP mechanism with a smaller μ has these rates.
    """
    fpr, fnr = np.asarray(fpr_upper, dtype=float), np.asarray(fnr_upper, dtype=float)
    return np.maximum(0.0, special.ndtri(1.0 - fpr) - special.ndtri(fnr))


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of a μ-GDP mechanism (Dong, Roth & Su, Cor. 2.13); 0 for μ = 0, ∞ for δ = 0 < μ."""
    mu, delta = float(mu), check_delta(delta)
    if mu <= 0.0:
        return 0.0
    if delta == 0.0 or math.isinf(mu):
        return math.inf
    return float(eps_from_mu(mu=mu, delta=delta))


def plain_epsilon_lower_bound(fpr_upper, fnr_upper, delta: float) -> np.ndarray:
    """``max(log((1−δ−FNR)/FPR), log((1−δ−FPR)/FNR), 0)``.

    No (ε, δ)-DP mechanism with a smaller ε allows these rates.
    """
    fpr, fnr = np.asarray(fpr_upper, dtype=float), np.asarray(fnr_upper, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.log(np.maximum(1.0 - delta - fnr, 0.0)) - np.log(fpr)
        second = np.log(np.maximum(1.0 - delta - fpr, 0.0)) - np.log(fnr)
    bound = np.fmax(np.fmax(first, second), 0.0)
    return np.where(np.isnan(bound), 0.0, bound)


def error_rate_upper_bounds(false_positives, negatives, false_negatives, positives,
                            confidence: float) -> Tuple[np.ndarray, np.ndarray]:
    """Clopper–Pearson upper limits on FPR and FNR that hold together with prob. ≥ ``confidence``."""
    alpha = 1.0 - check_confidence(confidence)
    return (clopper_pearson_upper(false_positives, negatives, alpha / 2),
            clopper_pearson_upper(false_negatives, positives, alpha / 2))


def gaussian_mechanism_mu(*, noise_multiplier: float, steps: int) -> float:
    """μ = √T/σ of T full-batch (q = 1) Gaussian steps with noise multiplier σ (∞ for σ = 0)."""
    if noise_multiplier == 0:
        return math.inf
    return math.sqrt(steps) / noise_multiplier
