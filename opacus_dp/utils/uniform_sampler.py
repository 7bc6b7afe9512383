"""Compatibility import path (Opacus 0.x/1.x ``opacus.utils.uniform_sampler``).

The samplers live in ``opacus_dp.data.samplers``.
"""

from opacus_dp.data.samplers import (
    DistributedPoissonBatchSampler,
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)

__all__ = [
    "DistributedPoissonBatchSampler",
    "DistributedUniformWithReplacementSampler",
    "UniformWithReplacementSampler",
]
