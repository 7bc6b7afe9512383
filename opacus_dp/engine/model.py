"""The model of a private run: validation and the per-sample-gradient wrapper (from the one
mode table, :mod:`opacus_dp.grad_sample.mode_selection`)."""

from typing import Optional, Type

import torch.nn as nn

from opacus_dp.engine.arguments import check_choice
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.grad_sample.compiled_modules import compile_like, take_compiled
from opacus_dp.grad_sample.mode_selection import MODE_NAMES, wrap_for_engine
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.validators import ModuleValidator
from opacus_dp.validators.module_errors import UnsupportedModuleError, combined_error


def validate_module(module: nn.Module, error_class: Type[UnsupportedModuleError] = UnsupportedModuleError) -> None:
    """Refuse a model that cannot be trained privately, with the validator's message, as an
    ``error_class`` (a subclass of ``UnsupportedModuleError``: Opacus 0.x's
    ``IncompatibleModuleException`` for the classic engine)."""
    try:
        ModuleValidator.validate(unwrap_model(module), strict=True)
    except UnsupportedModuleError as error:
        if isinstance(error, error_class):
            raise
        raise combined_error(getattr(error, "errors", [error]), error_class) from None


def wrap_module(module: nn.Module, *, grad_sample_mode: str, batch_first: bool, loss_reduction: str,
                skip_weight_grads: Optional[bool] = None):
    """The per-sample-gradient wrapper of ``module`` for ``grad_sample_mode`` (``skip_weight_grads``:
    see :mod:`~opacus_dp.grad_sample.mode_selection`; None is the mode's default).

    A GradSampleModule passed in is reused if its settings agree, else ValueError. A model passed
    compiled (``torch.compile(model)``) is wrapped uncompiled, and the wrapper compiled alike.
    """
    check_choice(grad_sample_mode, MODE_NAMES, "grad_sample_mode")
    module, compiled = take_compiled(module)
    if compiled is not None:
        wrapper = wrap_module(module, grad_sample_mode=grad_sample_mode, batch_first=batch_first,
                              loss_reduction=loss_reduction, skip_weight_grads=skip_weight_grads)
        return compile_like(wrapper, compiled)
    if isinstance(module, GradSampleModule):
        wanted = (batch_first, loss_reduction, grad_sample_mode == "functorch")
        found = (module.batch_first, module.loss_reduction, bool(module.force_functorch))
        norms_only = isinstance(module, BookkeepingGradSampleModule)
        mode_fits = grad_sample_mode == "auto" or norms_only == (grad_sample_mode in ("ghost", "bk"))
        if wanted != found or not mode_fits:
            raise ValueError(
                f"module is already a {type(module).__name__} with (batch_first, loss_reduction, "
                f"functorch)={found}, but {wanted} and grad_sample_mode={grad_sample_mode!r} were "
                "requested: pass the unwrapped model"
            )
        return module
    return wrap_for_engine(module, grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction,
                           skip_weight_grads=skip_weight_grads)
