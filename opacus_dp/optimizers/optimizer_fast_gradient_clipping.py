"""Opacus 1.x path `opacus.optimizers.optimizer_fast_gradient_clipping` (compatibility):
:class:`DPOptimizerFastGradientClipping`."""

from opacus_dp.optimizers import DPOptimizerFastGradientClipping

__all__ = ["DPOptimizerFastGradientClipping"]
