"""Compatibility import path (Opacus 1.x ``opacus.utils.batch_memory_manager``).

The implementation lives in ``opacus_dp.data.batch_memory_manager``.
"""

from opacus_dp.data.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler, wrap_data_loader

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]
