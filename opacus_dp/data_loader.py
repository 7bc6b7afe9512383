"""Compatibility import path (Opacus 1.x ``opacus.data_loader``).

The implementation lives in ``opacus_dp.data``.
"""

from opacus_dp.data.collate import EmptyBatchCollate
from opacus_dp.data.data_loader import DPDataLoader, switch_generator

__all__ = ["DPDataLoader", "EmptyBatchCollate", "switch_generator"]
