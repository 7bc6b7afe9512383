"""Opacus 0.x ``opacus.utils.clipping``: the ``ClippingMethod`` names of the classic engine.

Only ``ClippingMethod.STATIC`` (a fixed ``max_grad_norm``) is private: the dynamic methods of
Opacus 0.x (``PVALUE``, ``MEAN``, ``GMM``, ``OTSU``, with ``experimental=True``) set the bound
from each batch's gradient norms without noise, so the classic ``PrivacyEngine`` refuses them;
``PrivacyEngine().make_private(..., clipping="adaptive")`` estimates a quantile privately.
0.x's clipper classes (``ConstantFlatClipper``, ...) are internal to its engine: clipping here
is done by :class:`~opacus_dp.optim.DPOptimizer` (see docs/compatibility.md).
"""

from enum import IntEnum


class ClippingMethod(IntEnum):
    """Opacus 0.x's clipping methods (values as in 0.x)."""

    STATIC = 0
    PVALUE = 1
    MEAN = 2
    GMM = 3
    OTSU = 4


__all__ = ["ClippingMethod"]
