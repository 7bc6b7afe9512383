"""Opacus 1.x's import path ``opacus.validators.utils`` (re-exports only): register validators
and fixers for module types (:mod:`opacus_dp.validators.registration`)."""

from opacus_dp.validators.registration import (DEFAULT_MODULE_VALIDATOR, register_module_fixer,
                                                     register_module_validator)

__all__ = ["DEFAULT_MODULE_VALIDATOR", "register_module_fixer", "register_module_validator"]
