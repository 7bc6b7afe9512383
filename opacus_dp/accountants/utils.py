"""Compatibility path of Opacus 1.x (``opacus.accountants.utils``): noise calibration."""

from opacus_dp.accountants.calibration import MAX_SIGMA, get_noise_multiplier

__all__ = ["get_noise_multiplier", "MAX_SIGMA"]
