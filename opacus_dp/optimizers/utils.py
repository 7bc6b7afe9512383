"""Opacus 1.x's import path ``opacus.optimizers.utils`` (re-exports only)."""

from opacus_dp.compat.optimizer_utils import params

__all__ = ["params"]
