"""Opacus 1.x's import path ``opacus.validators.errors`` (re-exports only): the error classes of
``ModuleValidator`` (:mod:`opacus_dp.validators.module_errors`)."""

from opacus_dp.errors import UnsupportedError, UnsupportedModuleError
from opacus_dp.validators.module_errors import (
    IllegalModuleConfigurationError,
    IncompatibleModuleException,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    combined_error,
)

__all__ = ["IllegalModuleConfigurationError", "IncompatibleModuleException", "NotYetSupportedModuleError",
           "ShouldReplaceModuleError", "UnsupportableModuleError", "UnsupportedError", "UnsupportedModuleError",
           "combined_error"]
