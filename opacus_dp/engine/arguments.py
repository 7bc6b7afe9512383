"""Argument checks shared by the two PrivacyEngine APIs (named errors before anything changes)."""

import math
import warnings
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp.data import UniformWithReplacementSampler
from opacus_dp.optim.clipper_registry import clipping_names
from opacus_dp.optim.clipping import check_max_grad_norm
from opacus_dp.optim.noise import check_noise_multiplier

CLIPPING_MODES = tuple(clipping_names())  # the rules of opacus_dp.optim.clipper_registry


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
