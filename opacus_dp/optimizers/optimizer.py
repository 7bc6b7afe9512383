"""Opacus 1.x path `opacus.optimizers.optimizer` (compatibility): :class:`DPOptimizer`."""

from opacus_dp.optimizers import DPOptimizer

__all__ = ["DPOptimizer"]
