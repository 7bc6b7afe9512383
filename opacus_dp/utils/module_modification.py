"""Opacus 0.x's import path ``opacus.utils.module_modification`` (re-exports only; in-place
BatchNorm conversion, :mod:`opacus_dp.compat.module_modification`)."""

from opacus_dp.compat.module_modification import (  # noqa: F401  (0.x's converters, private there too)
    _batchnorm_to_groupnorm,
    _batchnorm_to_instancenorm,
    _nullify_batch_norm,
    convert_batchnorm_modules,
    nullify_batchnorm_modules,
    replace_all_modules,
)

__all__ = ["convert_batchnorm_modules", "nullify_batchnorm_modules", "replace_all_modules"]
