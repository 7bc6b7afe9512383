"""Opacus 1.x's ``opacus.validators.utils``: register validators and fixers for module types.

Registered functions run besides the built-in rules (validators) or instead of them (fixers),
for modules of exactly the registered types.
"""

from typing import Callable, Iterable, Type, Union

import torch.nn as nn

from opacus_dp.validators.module_validator import ModuleValidator

DEFAULT_MODULE_VALIDATOR = ModuleValidator
ModuleTypes = Union[Type[nn.Module], Iterable[Type[nn.Module]]]


def _register(table: dict, target_classes: ModuleTypes) -> Callable:
    classes = list(target_classes) if isinstance(target_classes, (list, tuple, set)) else [target_classes]

    def decorator(fn: Callable) -> Callable:
        for cls in classes:
            table[cls] = fn
        return fn

    return decorator


def register_module_validator(target_classes: ModuleTypes, validator_class=DEFAULT_MODULE_VALIDATOR) -> Callable:
    """Decorator: ``fn(module) -> list of errors`` also runs on modules of exactly these types."""
    return _register(validator_class.VALIDATORS, target_classes)


def register_module_fixer(target_classes: ModuleTypes, validator_class=DEFAULT_MODULE_VALIDATOR) -> Callable:
    """Decorator: ``fn(module) -> replacement`` replaces modules of exactly these types in ``fix``."""
    return _register(validator_class.FIXERS, target_classes)


__all__ = ["DEFAULT_MODULE_VALIDATOR", "register_module_fixer", "register_module_validator"]
