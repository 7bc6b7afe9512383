"""Membership scores from white-box observations: the per-canary log-likelihood ratio.

Under the claimed mechanism the observations of one canary over T steps are independent,
``x_t ~ N(b_t, σ²)``, with ``b_t = 0`` for an absent canary and ``b_t ~ Bernoulli(q)`` for a
present one (Poisson sampling with rate q). The Neyman–Pearson optimal statistic is the
log-likelihood ratio

    score = Σ_t log(1 − q + q·exp((x_t − 1/2)/σ²)),

which for q = 1 is ``(Σ_t x_t − T/2)/σ²``: the sum test of Nasr et al. 2023 ("Tight Auditing
of Differentially Private Machine Learning"), whose two hypotheses are then exactly
``N(0, 1)`` and ``N(√T/σ, 1)`` after normalisation (μ-GDP with μ = √T/σ). Any score gives valid
bounds; this one gives the tightest. ``score ≥ 0`` is the maximum-likelihood guess.
"""

import math

import numpy as np
import torch


def membership_scores(observations, *, noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """``(m,)`` log-likelihood ratios from ``(T, m)`` observations (σ = 0: the plain sum − T/2)."""
    x = torch.as_tensor(observations).detach().to(torch.float64).cpu().numpy()
    if x.ndim != 2:
        raise ValueError(f"observations must have shape (steps, canaries), got {x.shape}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    if noise_multiplier == 0:
        return x.sum(axis=0) - 0.5 * x.shape[0]
    shifted = (x - 0.5) / (noise_multiplier ** 2)
    if sample_rate == 1.0:
        return shifted.sum(axis=0)
    per_step = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + shifted)
    return per_step.sum(axis=0)
