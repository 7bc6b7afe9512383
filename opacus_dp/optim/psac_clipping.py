"""Per-sample adaptive clipping (PSAC): normalisation that shrinks small gradients less.

Xia, Shen, Wang, Ma, Yang & Li 2023, "Differentially Private Learning with Per-Sample Adaptive
Clipping" (AAAI). With ``‖g_i‖`` the norm of sample ``i``'s whole gradient and ``r > 0``:

    f_i = C / (‖g_i‖ + r / (‖g_i‖ + r))

The offset ``r / (‖g_i‖ + r)`` lies in ``(0, 1]``: it is 1 for a zero gradient and vanishes for a
large one, so a small gradient is not inflated towards ``C`` as under automatic clipping's fixed
``γ``. As ``r / (‖g_i‖ + r) > 0``, ``‖f_i g_i‖ < C``: sensitivity ``C``, noise std ``σ · C``.
A dropped sample (norm ``+inf``) gets ``f_i = C / (∞ + 0) = 0``, not NaN.
"""

import torch

from opacus_dp.optim.automatic_clipping import NormalisingClipper
from opacus_dp.optim.clipping import PSAC_R_SETTING

DEFAULT_R = 0.1


class PSACClipper(NormalisingClipper):
    """PSAC (module doc): ``f_i = C / (‖g_i‖ + r / (‖g_i‖ + r))``.

    Args:
        max_grad_norm: ``C`` (finite), the bound every clipped gradient stays below.
        r: the constant ``r > 0`` of the offset (default 0.1).
    """

    option = "r"
    setting = PSAC_R_SETTING

    def __init__(self, max_grad_norm: float, r: float = DEFAULT_R):
        super().__init__(max_grad_norm, r)

    @property
    def r(self) -> float:
        return self.constant

    def offset(self, norms: torch.Tensor) -> torch.Tensor:
        return self.constant / (norms + self.constant)
