"""Compatibility import path (Opacus 0.14/0.15 ``opacus.layers.dp_ddp``).

Re-exports :class:`opacus_dp.distributed.DifferentiallyPrivateDistributedDataParallel`;
and 0.x's helper ``average_gradients``.
"""

from opacus_dp.distributed.average import average_gradients
from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel


__all__ = ["DifferentiallyPrivateDistributedDataParallel", "average_gradients"]
