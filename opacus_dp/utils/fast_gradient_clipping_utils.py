"""Opacus 1.6's import path ``opacus.utils.fast_gradient_clipping_utils`` (re-exports only)."""

from opacus_dp.compat.fast_gradient_clipping import DPLossFastGradientClipping, DPTensorFastGradientClipping

__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]
