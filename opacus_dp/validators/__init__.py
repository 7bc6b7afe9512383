"""Model validation for DP-SGD: ``ModuleValidator.validate`` / ``fix`` (Opacus 1.x API)."""

from opacus_dp.validators.fixers import default_num_groups
from opacus_dp.validators.module_errors import (
    IllegalModuleConfigurationError,
    IncompatibleModuleException,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedError,
    UnsupportedModuleError,
)
from opacus_dp.validators.module_validator import ModuleValidator
from opacus_dp.validators.registration import register_module_fixer, register_module_validator

__all__ = [
    "IllegalModuleConfigurationError",
    "IncompatibleModuleException",
    "ModuleValidator",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedError",
    "UnsupportedModuleError",
    "default_num_groups",
    "register_module_fixer",
    "register_module_validator",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
