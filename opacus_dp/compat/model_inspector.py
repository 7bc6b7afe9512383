"""Classic model inspection (Opacus 0.x API): ``DPModelInspector().validate(model)``.

The verdicts are Opacus 0.15's: every module owning a trainable parameter must have a dedicated
grad sampler (``opacus_dp.grad_sample.register_grad_sampler`` adds one), be in training mode,
and a ``Conv2d`` must have ``groups`` 1 or ``in_channels``; BatchNorm, LSTM and InstanceNorm with
running statistics are refused. Where 0.15 let a privacy problem through, the model is refused
as by ``ModuleValidator`` (an InstanceNorm or parameter-free BatchNorm updating running
statistics from the batch, ``Embedding(max_norm=...)``; see docs/compatibility.md).
``PrivacyEngine.attach`` validates with ``ModuleValidator``, which also accepts layers 0.15 could
not train (the generic per-sample gradient fallback, any conv groups).
"""

from typing import List, Set

import torch.nn as nn

import opacus_dp.grad_sample  # noqa: F401  (registers the built-in grad samplers)
from opacus_dp.compat.module_inspection import ModelInspector, get_layer_type
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS, find_sampler
from opacus_dp.validators.module_errors import (IllegalModuleConfigurationError, IncompatibleModuleException,
                                                NotYetSupportedModuleError, UnsupportedModuleError, combined_error)
from opacus_dp.validators.module_validator import ModuleValidator, module_path


def _has_grad_sampler(module: nn.Module) -> bool:
    return find_sampler(GRAD_SAMPLERS, module) is not None


def _conv_groups_supported(module: nn.Module) -> bool:
    return not isinstance(module, nn.Conv2d) or module.groups in (1, module.in_channels)


def _in_training_mode(module: nn.Module) -> bool:
    return module.training


# (inspector, error class, fix) of the 0.15 checks the shared rules do not cover
_CLASSIC_CHECKS = (
    (ModelInspector("validity", _has_grad_sampler,
                    message="grad_sampler method is not yet supported for this module"),
     NotYetSupportedModuleError,
     "register one with opacus_dp.grad_sample.register_grad_sampler, or validate with "
     "ModuleValidator (PrivacyEngine.attach does), which computes it with the generic fallback"),
    (ModelInspector("conv_group_number", _conv_groups_supported,
                    message="Number of groups in Conv2d layer must be either 1 or equal to number of channels"),
     NotYetSupportedModuleError,
     "use groups=1 or groups=in_channels, or validate with ModuleValidator, which accepts any groups"),
    (ModelInspector("train_mode", _in_training_mode,
                    message="the model must be in training mode to compute per-sample gradients"),
     IllegalModuleConfigurationError, "call model.train()"),
)


def classic_violations(model: nn.Module) -> List[UnsupportedModuleError]:
    """Every violation of ``model`` under the 0.15 checks and the shared privacy rules, one per
    module and check (a module the shared rules flag is not reported again as unsupported)."""
    errors = ModuleValidator.sub_module_errors(model)
    flagged: Set[str] = {str(e).split(" ", 1)[0] for e in errors}
    for inspector, error_class, fix in _CLASSIC_CHECKS:
        for name, module in model.named_modules():
            path = module_path(name)
            if inspector.predicate(module) or (inspector.name == "validity" and path in flagged):
                continue
            flagged.add(path)
            error = error_class(f"{path} ({get_layer_type(module)}) cannot be private: "
                                f"{inspector.message}; fix: {fix}")
            errors.append(error)
    return errors


class DPModelInspector:
    """Checks that a model can be trained with DP-SGD (Opacus 0.x entry point; module doc).

    ``validate(model)`` returns True, or raises one ``IncompatibleModuleException`` listing every
    violation (``.errors``); with ``should_throw=False`` it returns False instead. The violations
    of the last call are kept in ``violations``; ``inspectors`` lists the 0.15-specific checks.
    """

    def __init__(self, should_throw: bool = True):
        self.should_throw = should_throw
        self.inspectors = [inspector for inspector, _, _ in _CLASSIC_CHECKS]
        self.violations: List[UnsupportedModuleError] = []

    def validate(self, model: nn.Module) -> bool:
        """``True`` if ``model`` is valid; else raise ``IncompatibleModuleException`` (or return ``False``)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.violations = classic_violations(model)
        if not self.violations:
            return True
        if self.should_throw:
            raise combined_error(self.violations, IncompatibleModuleException)
        return False


__all__ = ["DPModelInspector", "IncompatibleModuleException"]
