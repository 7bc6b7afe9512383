"""Opacus 1.x path `opacus.optimizers.fsdpoptimizer_fast_gradient_clipping` (compatibility):
:class:`FSDPOptimizerFastGradientClipping` (built by ``make_private`` for an FSDP2 model)."""

from opacus_dp.optimizers import FSDPOptimizerFastGradientClipping

__all__ = ["FSDPOptimizerFastGradientClipping"]
