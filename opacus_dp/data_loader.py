"""Opacus 1.x's import path ``opacus.data_loader`` (re-exports only).

The loader lives in :mod:`opacus_dp.data`; Opacus's collate wrappers in
:mod:`opacus_dp.compat.collate`.
"""

from opacus_dp.compat.collate import CollateFnWithEmpty, dtype_safe, shape_safe, wrap_collate_with_empty
from opacus_dp.data.collate import EmptyBatchCollate
from opacus_dp.data.data_loader import DPDataLoader, switch_generator

__all__ = ["CollateFnWithEmpty", "DPDataLoader", "EmptyBatchCollate", "dtype_safe", "shape_safe",
           "switch_generator", "wrap_collate_with_empty"]
