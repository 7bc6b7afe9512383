"""Opacus 0.x's import path ``opacus.utils.module_inspection`` (re-exports only)."""

from opacus_dp.compat.module_inspection import (ModelInspector, get_layer_type, has_no_param, is_trainable_leaf,
                                                requires_grad)

__all__ = ["ModelInspector", "get_layer_type", "has_no_param", "is_trainable_leaf", "requires_grad"]
