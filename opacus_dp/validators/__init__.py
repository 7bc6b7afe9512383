"""Model validation for DP-SGD: ``ModuleValidator.validate`` / ``fix`` (Opacus 1.x API)."""

from typing import Callable, Iterable, Type, Union

import torch.nn as nn

from opacus_dp.validators.errors import (
    IllegalModuleConfigurationError,
    IncompatibleModuleException,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedModuleError,
)
from opacus_dp.validators.fixers import default_num_groups
from opacus_dp.validators.module_validator import ModuleValidator

ModuleTypes = Union[Type[nn.Module], Iterable[Type[nn.Module]]]


def _register(table: dict, target_classes: ModuleTypes) -> Callable:
    classes = list(target_classes) if isinstance(target_classes, (list, tuple, set)) else [target_classes]

    def decorator(fn: Callable) -> Callable:
        for cls in classes:
            table[cls] = fn
        return fn

    return decorator


def register_module_validator(target_classes: ModuleTypes) -> Callable:
    """Decorator: ``fn(module) -> list of errors`` also runs on modules of exactly these types."""
    return _register(ModuleValidator.VALIDATORS, target_classes)


def register_module_fixer(target_classes: ModuleTypes) -> Callable:
    """Decorator: ``fn(module) -> replacement`` replaces modules of exactly these types in ``fix``."""
    return _register(ModuleValidator.FIXERS, target_classes)


__all__ = [
    "IllegalModuleConfigurationError",
    "IncompatibleModuleException",
    "ModuleValidator",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedModuleError",
    "default_num_groups",
    "register_module_fixer",
    "register_module_validator",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
