"""Classic model inspection (Opacus 0.x API): ``DPModelInspector().validate(model)``.

Applies the same rules as ``opacus_dp.validators.ModuleValidator`` and reports with the same
messages, but in the 0.x style: ``True`` when the model is fine, otherwise one
``IncompatibleModuleException`` listing every violation.
"""

import torch.nn as nn

from opacus_dp.validators.errors import IncompatibleModuleException, combined_error
from opacus_dp.validators.module_validator import ModuleValidator


class DPModelInspector:
    """Checks that a model can be trained with DP-SGD (Opacus 0.x entry point).

    With ``should_throw=False``, ``validate`` returns ``False`` instead of raising; the
    violations of the last call are kept in ``violations``.
    """

    def __init__(self, should_throw: bool = True):
        self.should_throw = should_throw
        self.violations = []

    def validate(self, model: nn.Module) -> bool:
        """``True`` if ``model`` is valid; else raise ``IncompatibleModuleException`` (or return ``False``)."""
        self.violations = ModuleValidator.validate(model, strict=False)
        if not self.violations:
            return True
        if self.should_throw:
            raise combined_error(self.violations, IncompatibleModuleException)
        return False


__all__ = ["DPModelInspector", "IncompatibleModuleException"]
