"""Opacus 1.x's import path ``opacus.utils.module_utils`` (re-exports only)."""

from opacus_dp.compat.module_utils import (
    are_state_dict_equal,
    clone_module,
    get_submodule,
    has_trainable_params,
    parametrized_modules,
    requires_grad,
    trainable_modules,
    trainable_parameters,
)

__all__ = ["are_state_dict_equal", "clone_module", "get_submodule", "has_trainable_params", "parametrized_modules",
           "requires_grad", "trainable_modules", "trainable_parameters"]
