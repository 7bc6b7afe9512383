"""Rényi-DP accountant (moments accountant) for DP-SGD.

Per segment (σ, q, T) the RDP curve of the sampled Gaussian mechanism (Mironov, Talwar &
Zhang 2019) is multiplied by T; segments add up; the total is converted to (ε, δ) with
Balle et al. (2020), Thm 21 — see :mod:`opacus_dp.accountants.analysis.rdp`.
"""

import functools
from typing import Optional, Sequence, Tuple

import numpy as np

from opacus_dp.accountants.privacy_accountant import PrivacyAccountant
from opacus_dp.accountants.analysis import rdp as rdp_analysis
from opacus_dp.accountants.validation import check_delta, check_orders


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(q: float, sigma: float, orders: Tuple[float, ...]) -> Tuple[float, ...]:
    return tuple(rdp_analysis.compute_rdp(q, sigma, 1, list(orders)))


class RDPAccountant(PrivacyAccountant):
    """Tracks the RDP of the composed sampled Gaussian steps at a fixed set of orders.

    Args:
        alphas: RDP orders searched for the best (ε, δ) conversion;
            defaults to :attr:`DEFAULT_ALPHAS` (the orders Opacus uses).
    """

    DEFAULT_ALPHAS = rdp_analysis.DEFAULT_ALPHAS

    def __init__(self, alphas: Optional[Sequence[float]] = None) -> None:
        super().__init__()
        self.alphas = list(self.DEFAULT_ALPHAS) if alphas is None else check_orders(alphas)

    @classmethod
    def mechanism(cls) -> str:
        return "rdp"

    def compute_rdp(self, alphas: Optional[Sequence[float]] = None) -> np.ndarray:
        """RDP of the whole history at ``alphas`` (default: the accountant's orders)."""
        orders = tuple(self.alphas if alphas is None else check_orders(alphas))
        total = np.zeros(len(orders))
        for sigma, q, steps in self.history:
            if q > 0 and steps > 0:
                total = total + steps * np.asarray(_rdp_per_step(q, sigma, orders))
        return total

    def get_privacy_spent(
        self, *, delta: float, alphas: Optional[Sequence[float]] = None
    ) -> Tuple[float, float]:
        """``(ε, best_order)``: ε at δ and the RDP order achieving it (``nan`` only when ε is
        infinite; before any costly step ``(0, the smallest order)``, as the analysis gives for zero RDP)."""
        delta = check_delta(delta)
        orders = self.alphas if alphas is None else check_orders(alphas)
        if self._spends_nothing():
            return rdp_analysis.get_privacy_spent(orders, np.zeros(len(orders)), delta)
        return rdp_analysis.get_privacy_spent(orders, self.compute_rdp(orders), delta)

    def get_epsilon(self, delta: float, alphas: Optional[Sequence[float]] = None) -> float:
        """ε spent so far at δ, optimised over ``alphas`` (default: the accountant's orders)."""
        epsilon, _ = self.get_privacy_spent(delta=delta, alphas=alphas)
        return epsilon
