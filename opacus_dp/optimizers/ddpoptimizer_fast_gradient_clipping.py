"""Opacus 1.x path `opacus.optimizers.ddpoptimizer_fast_gradient_clipping` (compatibility):
:class:`DistributedDPOptimizerFastGradientClipping` (built by ``make_private``)."""

from opacus_dp.optimizers import DistributedDPOptimizerFastGradientClipping

__all__ = ["DistributedDPOptimizerFastGradientClipping"]
