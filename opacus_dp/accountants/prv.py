"""Numerical-composition accountant (PRV / privacy loss distribution) for DP-SGD.

The privacy loss random variable (PRV) of every step is discretised pessimistically on a
uniform grid ("connect the dots", Doroshenko et al. 2022), the steps are composed exactly by
FFT (Koskela et al. 2020; Gopi, Lee & Wutschitz 2021, "Numerical Composition of Differential
Privacy"), under an exponential tilt when δ is tiny, and ε(δ) is read off the composed
distribution.  Every approximation (grid, truncated tails, FFT window, round-off allowance)
can only increase δ(ε), so the reported ε is an upper bound — on standard settings within
10⁻⁷ relative of Google dp-accounting's pessimistic PLD; see
:mod:`opacus_dp.accountants.analysis.prv`.
"""

from typing import Optional

from opacus_dp.accountants.privacy_accountant import PrivacyAccountant
from opacus_dp.accountants.analysis.prv.dpsgd import compute_epsilon
from opacus_dp.accountants.validation import check_delta

_MAX_GRID_STEP = 1e-4


class PRVAccountant(PrivacyAccountant):
    """Tight ε for (mixed) histories of Poisson-subsampled Gaussian steps."""

    @classmethod
    def mechanism(cls) -> str:
        return "prv"

    def get_epsilon(self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None) -> float:
        """Upper bound on ε at δ.

        Args:
            delta: target δ in (0, 1).
            eps_error: accuracy knob (name kept from Opacus): the loss grid step is
                ``min(1e-4, eps_error / 100)``; it is coarsened only for extreme histories.
            delta_error: truncation budget; at most ``delta_error / 1000`` (default
                ``delta / 10**6``) of probability is moved to the infinite loss, which is
                charged to δ, so the bound holds for the requested δ.
        """
        delta = check_delta(delta)
        if not eps_error > 0:
            raise ValueError(f"eps_error must be > 0, got {eps_error!r}")
        if delta_error is None:
            delta_error = delta / 1000
        elif not 0 < delta_error < delta:
            raise ValueError(f"delta_error must lie in (0, delta), got {delta_error!r}")
        if self._spends_nothing():
            return 0.0
        grid_step = min(_MAX_GRID_STEP, eps_error / 100)
        return compute_epsilon(self.history, delta, grid_step, delta_error / 1000)
