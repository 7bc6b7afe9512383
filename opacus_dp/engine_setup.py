"""Building blocks shared by the two PrivacyEngine APIs: argument checks, model wrapping (from
the one mode table, :mod:`opacus_dp.grad_sample.mode_selection`), the optimizer.
"""

import math
import secrets
import warnings
from typing import Dict, List, Optional, Sequence, Type, Union

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp.data import UniformWithReplacementSampler
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.grad_sample.bookkeeping.ghost_criterion import GhostCriterion, StepClipping
from opacus_dp.grad_sample.compiled_modules import compile_like, take_compiled
from opacus_dp.grad_sample.mode_selection import MODE_NAMES, wrap_for_engine
from opacus_dp.model_wrappers import parameter_names, unwrap_model  # noqa: F401  (also imported from here)
from opacus_dp.optim import BatchingPolicy, DPOptimizer, grad_source_for
from opacus_dp.optim.clipping import check_max_grad_norm
from opacus_dp.optim.noise import check_noise_multiplier
from opacus_dp.state_views import OPACUS_1X, StateViews
from opacus_dp.validators import ModuleValidator
from opacus_dp.validators.errors import UnsupportedModuleError, combined_error

CLIPPING_MODES = ("flat", "per_layer", "adaptive")


def check_choice(value, choices: Sequence[str], name: str) -> str:
    """``value`` if it is one of ``choices``, else ValueError naming ``name``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_privacy_arguments(*, noise_multiplier, max_grad_norm, loss_reduction: str,
                            clipping: str) -> None:
    """Early, named errors for σ, C (or the per-layer list), loss_reduction and clipping."""
    check_noise_multiplier(noise_multiplier)
    check_choice(loss_reduction, ("mean", "sum"), "loss_reduction")
    check_choice(clipping, CLIPPING_MODES, "clipping")
    if isinstance(max_grad_norm, (list, tuple)):
        if clipping != "per_layer":
            raise ValueError("max_grad_norm is a list: pass clipping='per_layer' (one bound per tensor)")
        for i, c in enumerate(max_grad_norm):
            check_max_grad_norm(c, f"max_grad_norm[{i}]")
    else:
        if clipping == "per_layer":
            raise ValueError("clipping='per_layer' needs max_grad_norm as a list, one bound per "
                             "trainable tensor")
        bound = check_max_grad_norm(max_grad_norm)
        if math.isinf(bound) and noise_multiplier > 0:
            raise ValueError("max_grad_norm=inf (no clipping) only makes sense with noise_multiplier=0")


def adaptive_options(clipping: str, **options) -> Optional[Dict[str, float]]:
    """The adaptive-clipping settings given (None values left to the defaults) for
    ``clipping="adaptive"``; None for the other modes, which refuse any such setting."""
    given = sorted(name for name, value in options.items() if value is not None)
    if clipping == "adaptive":
        return {name: value for name, value in options.items() if value is not None}
    if given:
        raise ValueError(f"{', '.join(given)} only apply to clipping='adaptive' (clipping={clipping!r} "
                         "keeps max_grad_norm fixed): pass clipping='adaptive' or drop them")
    return None


def check_optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ValueError if ``optimizer`` holds a tensor that is not a parameter of ``module``."""
    known = {id(p) for p in module.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in known:
                raise ValueError(
                    f"Module parameters are different than optimizer Parameters: "
                    f"optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a "
                    "parameter of the module (was the model changed, e.g. by ModuleValidator.fix, after "
                    "the optimizer was built?): build the optimizer from module.parameters() "
                    "of the model passed to the privacy engine"
                )


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


def secure_generator() -> torch.Generator:
    """A CPU generator seeded with 63 bits from the operating system's CSPRNG."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def make_dp_optimizer(optimizer, *, grad_sample_module, noise_multiplier: float,
                      max_grad_norm: Union[float, List[float]], expected_batch_size: Optional[float],
                      loss_reduction: str, clipping: str, generator=None,
                      secure_mode: bool = False, batching: Optional[BatchingPolicy] = None,
                      state_views: StateViews = OPACUS_1X) -> DPOptimizer:
    """A :class:`DPOptimizer` reading per-sample gradients from ``grad_sample_module``, with the
    engine's :class:`BatchingPolicy`; both show their state with the lifecycle ``state_views``
    (:mod:`opacus_dp.state_views`: Opacus 1.x's for ``make_private``, 0.x's for ``attach``)."""
    grad_sample_module.use_state_views(state_views)
    dp_optimizer = DPOptimizer(
        optimizer,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        loss_reduction=loss_reduction,
        generator=generator,
        secure_mode=secure_mode,
        clipping=clipping,
        grad_source=grad_source_for(grad_sample_module),
        param_names=parameter_names(grad_sample_module),
        batching=batching,
    )
    dp_optimizer.use_state_views(state_views)
    return dp_optimizer


def ghost_criterion(criterion, loss_reduction: str, module, optimizer):
    """The criterion returned in ghost mode (Opacus 1.6 returns one, default cross-entropy):
    its losses run the two-pass backward (see opacus_dp.grad_sample.bookkeeping.ghost_criterion)."""
    if criterion is None:
        criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
    clipping = StepClipping(params=lambda: optimizer.params, clip_factors=optimizer.clip_factors)
    return GhostCriterion(criterion, loss_reduction, module=module, clipping=clipping)


def refuse_skipped_empty_draws(data_loader: DataLoader) -> None:
    """A 0.x ``UniformWithReplacementSampler`` skips its empty draws (:mod:`opacus_dp.data.empty_draws`);
    this engine would neither step on them nor account them, which under-reports ε."""
    sampler = getattr(data_loader, "batch_sampler", None)
    if isinstance(sampler, UniformWithReplacementSampler) and sampler.skip_empty:
        raise ValueError(
            "data_loader draws Poisson batches with UniformWithReplacementSampler, which skips empty "
            "draws: with poisson_sampling=False they would be neither steps nor accounted (epsilon "
            "under-reported). Pass poisson_sampling=True (the engine then samples itself), or "
            "UniformWithReplacementSampler(..., skip_empty=False) with a collate_fn that accepts an "
            "empty list")


def check_opacus_flags(wrap_model, rand_on_empty) -> None:
    for name, value in (("wrap_model", wrap_model), ("rand_on_empty", rand_on_empty)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if rand_on_empty:
        warnings.warn("rand_on_empty=True has no effect: empty Poisson batches are delivered as "
                      "batches with zero rows, which every grad_sample_mode handles", UserWarning)
