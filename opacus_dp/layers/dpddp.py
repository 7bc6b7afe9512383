"""Compatibility import path (Opacus 0.x): ``opacus_dp.layers.dpddp``.

Re-exports :class:`opacus_dp.distributed.DifferentiallyPrivateDistributedDataParallel`.
"""

from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel

__all__ = ["DifferentiallyPrivateDistributedDataParallel"]
