"""Opacus 1.x path `opacus.optimizers.ddp_perlayeroptimizer` (compatibility):
:class:`SimpleDistributedPerLayerOptimizer` and its alias ``DistributedPerLayerOptimizer``."""

from opacus_dp.optimizers import DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer

__all__ = ["SimpleDistributedPerLayerOptimizer", "DistributedPerLayerOptimizer"]
