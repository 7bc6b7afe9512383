"""Opacus 1.x path `opacus.optimizers.ddpoptimizer` (compatibility): :class:`DistributedDPOptimizer`."""

from opacus_dp.optimizers import DistributedDPOptimizer

__all__ = ["DistributedDPOptimizer"]
