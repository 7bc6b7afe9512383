"""Compatibility path of Opacus 0.x (``opacus.privacy_analysis``): RDP of the sampled
Gaussian mechanism and its conversion to (ε, δ).

Re-exports :mod:`opacus_dp.accountants.analysis.rdp`; ``get_privacy_spent`` uses the improved
conversion of Balle et al. (2020), Thm 21 (pass ``conversion="classic"`` for the older bound).
"""

from opacus_dp.accountants.analysis.rdp import DEFAULT_ALPHAS, compute_rdp, get_privacy_spent

__all__ = ["DEFAULT_ALPHAS", "compute_rdp", "get_privacy_spent"]
