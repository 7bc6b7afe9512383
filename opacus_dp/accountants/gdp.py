"""Gaussian-DP (central limit theorem) accountant — an approximation, not a bound.

See :mod:`opacus_dp.accountants.analysis.gdp`.  A warning is issued when it is created,
because for a finite number of steps the CLT can under-report ε; prefer ``"prv"``.
"""

import math
import warnings

from opacus_dp.accountants.privacy_accountant import PrivacyAccountant
from opacus_dp.accountants.analysis import gdp as gdp_analysis
from opacus_dp.accountants.validation import check_delta


class GaussianAccountant(PrivacyAccountant):
    """μ-GDP accounting by the CLT; segments with different (σ, q) compose as μ² = Σ μ_s²."""

    def __init__(self) -> None:
        warnings.warn(
            "GaussianAccountant (gdp) uses the central limit theorem: it approximates epsilon and "
            "can under-report it for a finite number of steps (Gopi et al. 2021, arXiv:2106.02848). "
            "Use accountant='prv' for a guaranteed upper bound.",
            UserWarning,
            stacklevel=2,
        )
        super().__init__()

    @classmethod
    def mechanism(cls) -> str:
        return "gdp"

    def get_mu(self, poisson: bool = True) -> float:
        """μ of the whole history (``poisson=False``: fixed-size uniformly sampled batches)."""
        compute_mu = gdp_analysis.compute_mu_poisson if poisson else gdp_analysis.compute_mu_uniform
        squares = [
            compute_mu(steps=steps, noise_multiplier=sigma, sample_rate=q) ** 2 for sigma, q, steps in self.history
        ]
        return math.sqrt(sum(squares))

    def get_epsilon(self, delta: float, poisson: bool = True) -> float:
        """CLT approximation of ε at δ (see the class warning)."""
        delta = check_delta(delta)
        return gdp_analysis.eps_from_mu(mu=self.get_mu(poisson), delta=delta)
