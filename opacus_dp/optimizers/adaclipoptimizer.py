"""Opacus 1.x path `opacus.optimizers.adaclipoptimizer` (compatibility): :class:`AdaClipDPOptimizer`."""

from opacus_dp.optimizers import AdaClipDPOptimizer

__all__ = ["AdaClipDPOptimizer"]
