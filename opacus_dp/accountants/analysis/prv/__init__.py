"""Pessimistic grid privacy loss distributions of the subsampled Gaussian mechanism,
their FFT composition and the resulting ε(δ) (see ``dpsgd.compute_epsilon``)."""

from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD, delta_for_epsilon, epsilon_for_delta
from opacus_dp.accountants.analysis.prv.dpsgd import compute_epsilon

__all__ = ["DiscretePLD", "compute_epsilon", "delta_for_epsilon", "epsilon_for_delta"]
