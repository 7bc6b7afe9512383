"""Opacus 0.x's import path ``opacus.dp_model_inspector`` (re-exports only; the inspector lives in
:mod:`opacus_dp.compat.model_inspector`)."""

from opacus_dp.compat.model_inspector import DPModelInspector, classic_violations
from opacus_dp.validators.module_errors import IncompatibleModuleException

__all__ = ["DPModelInspector", "IncompatibleModuleException", "classic_violations"]
