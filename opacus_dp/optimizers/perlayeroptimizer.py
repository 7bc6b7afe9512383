"""Opacus 1.x path `opacus.optimizers.perlayeroptimizer` (compatibility): :class:`DPPerLayerOptimizer`."""

from opacus_dp.optimizers import DPPerLayerOptimizer

__all__ = ["DPPerLayerOptimizer"]
