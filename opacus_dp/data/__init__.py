"""Data loading for DP-SGD: Poisson batch samplers, ``DPDataLoader``, ``BatchMemoryManager``.

* ``UniformWithReplacementSampler`` / ``DistributedPoissonBatchSampler``: each example enters each
  batch independently with probability q (the sampling the accountants analyse);
* ``DPDataLoader``: a DataLoader using them, delivering empty batches with the right structure;
* ``UnitPoissonSampler`` / ``UnitDataLoader``: Poisson sampling of privacy units of several rows
  (users with ``user_ids``, augmentation multiplicity), each batch's grouping delivered with it;
* ``BatchMemoryManager``: splits logical batches into physical ones (between units) and tells the
  optimizer when a logical batch ends;
* ``check_sampling``: warns when a loader is not Poisson-sampled.
"""

from opacus_dp.data.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler, wrap_data_loader
from opacus_dp.data.collate import EmptyBatchCollate, empty_like_batch
from opacus_dp.data.data_loader import DPDataLoader, switch_generator
from opacus_dp.data.samplers import (
    DistributedPoissonBatchSampler,
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from opacus_dp.data.sampling_checks import SamplingWarning, check_sampling, is_poisson_loader
from opacus_dp.data.unit_loader import UnitDataLoader
from opacus_dp.data.unit_sampling import UnitPoissonSampler

__all__ = [
    "BatchMemoryManager",
    "BatchSplittingSampler",
    "DPDataLoader",
    "DistributedPoissonBatchSampler",
    "DistributedUniformWithReplacementSampler",
    "EmptyBatchCollate",
    "SamplingWarning",
    "UniformWithReplacementSampler",
    "UnitDataLoader",
    "UnitPoissonSampler",
    "check_sampling",
    "empty_like_batch",
    "is_poisson_loader",
    "switch_generator",
    "wrap_data_loader",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
