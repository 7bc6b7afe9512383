"""Opacus's import path ``opacus.privacy_engine``: the engine lives in :mod:`opacus_dp.engine`."""

from opacus_dp.accountants import get_noise_multiplier
from opacus_dp.engine.classic_arguments import DEFAULT_ALPHAS
from opacus_dp.engine.modern import PrivacyEngine

__all__ = ["PrivacyEngine", "DEFAULT_ALPHAS", "get_noise_multiplier"]
