"""Opacus 1.x's import path ``opacus.optimizers`` (re-exports only).

opacus_dp has one optimizer class, :class:`~opacus_dp.optim.DPOptimizer`, whose clipping and
reduction are constructor arguments; Opacus's class names are views of it
(:mod:`opacus_dp.compat.optimizer_names`).
"""

from opacus_dp.compat.optimizer_names import (
    AdaClipDPOptimizer,
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DistributedPerLayerOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
    FSDPOptimizerFastGradientClipping,
    SimpleDistributedPerLayerOptimizer,
    get_optimizer_class,
)
from opacus_dp.optim import DPOptimizer
from opacus_dp.submodules import submodule_getattr

__all__ = ["DPOptimizer", "DPPerLayerOptimizer", "AdaClipDPOptimizer", "DPOptimizerFastGradientClipping",
           "DistributedDPOptimizer", "SimpleDistributedPerLayerOptimizer", "DistributedPerLayerOptimizer",
           "DistributedDPOptimizerFastGradientClipping", "FSDPOptimizerFastGradientClipping",
           "get_optimizer_class"]

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
