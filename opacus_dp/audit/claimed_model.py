"""Thresholds chosen in advance from the claimed mechanism, without looking at the audit data.

Under the claim (the engine's σ, q and T) the observations of an absent canary are
``x_t ~ N(0, σ²)`` and those of a present one ``x_t ~ N(b_t, σ²)``, ``b_t ~ Bernoulli(q)``.
Simulating this model (fixed seed) gives the false-positive and false-negative rate of every
threshold on the log-likelihood-ratio score; with the audit's numbers of absent and present
canaries, the threshold that maximises the expected Clopper–Pearson bound is then picked —
one for the GDP bound, one for the plain (ε, δ) bound. Since only the claim and the canary
counts are used, every canary can be used to evaluate the bound (no split is needed).
"""

from typing import Tuple

import numpy as np

from opacus_dp.audit.scores import membership_scores
from opacus_dp.audit.statistics import error_rate_upper_bounds, mu_lower_bound, plain_epsilon_lower_bound

SIMULATION_SEED = 20230126
_MAX_SIMULATED_DRAWS = 4_000_000
_NUM_CANDIDATES = 512


def simulate_scores(*, noise_multiplier: float, sample_rate: float, steps: int,
                    size: int, seed: int = SIMULATION_SEED) -> Tuple[np.ndarray, np.ndarray]:
    """``(absent, present)``: ``size`` scores each under the claimed mechanism."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((2, steps, size)) * noise_multiplier
    included = (rng.random((steps, size)) < sample_rate).astype(float)
    kwargs = dict(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return membership_scores(noise[0], **kwargs), membership_scores(noise[1] + included, **kwargs)


def model_thresholds(*, noise_multiplier: float, sample_rate: float, steps: int, negatives: int,
                     positives: int, delta: float, confidence: float) -> Tuple[float, float]:
    """``(τ for the GDP bound, τ for the plain bound)``.

    For ``negatives`` absent and ``positives`` present canaries under the claimed σ, q and T.
    """
    if negatives <= 0 or positives <= 0:
        return 0.0, 0.0
    size = int(max(2_000, min(20_000, _MAX_SIMULATED_DRAWS // steps)))
    absent, present = simulate_scores(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                      steps=steps, size=size)
    candidates = np.unique(np.quantile(np.concatenate([absent, present]),
                                       np.linspace(0.0, 1.0, _NUM_CANDIDATES)))
    absent, present = np.sort(absent), np.sort(present)
    fpr = 1.0 - np.searchsorted(absent, candidates, side="left") / size
    fnr = np.searchsorted(present, candidates, side="left") / size
    fpr_upper, fnr_upper = error_rate_upper_bounds(fpr * negatives, negatives, fnr * positives,
                                                   positives, confidence)
    by_mu = candidates[int(np.argmax(mu_lower_bound(fpr_upper, fnr_upper)))]
    by_plain = candidates[int(np.argmax(plain_epsilon_lower_bound(fpr_upper, fnr_upper, delta)))]
    return float(by_mu), float(by_plain)
