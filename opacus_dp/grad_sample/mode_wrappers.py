"""Opacus 1.x's ``get_gsm_class`` and ``wrap_model`` (``opacus.grad_sample.utils``): the
per-sample-gradient wrapper of each ``grad_sample_mode``, from the one mode table
(:mod:`~opacus_dp.grad_sample.mode_selection`)."""

from typing import Type

import torch.nn as nn

from opacus_dp.grad_sample.grad_sample_module import GradSampleModule
from opacus_dp.grad_sample.mode_selection import MODES

__all__ = ["get_gsm_class", "wrap_model"]


def get_gsm_class(grad_sample_mode: str) -> Type[GradSampleModule]:
    """The wrapper class of ``grad_sample_mode`` ("hooks", "functorch", "ew", "ghost", "bk")."""
    if grad_sample_mode not in MODES:
        raise ValueError(f"grad_sample_mode must be one of {', '.join(map(repr, MODES))}, got {grad_sample_mode!r}")
    return MODES[grad_sample_mode].opacus_class()


def wrap_model(model: nn.Module, grad_sample_mode: str, *, batch_first: bool = True,
               loss_reduction: str = "mean", **wrapper_options) -> GradSampleModule:
    """``model`` in the wrapper of ``grad_sample_mode``, built as its class builds it directly
    (so ``hooks`` keeps autograd's ``p.grad`` beside ``p.grad_sample``, as in Opacus) with the
    options that make the mode; ``wrapper_options`` go to that class too (e.g. ``max_grad_norm``
    for "ghost")."""
    wrapper = get_gsm_class(grad_sample_mode)
    mode = MODES[grad_sample_mode]
    options = dict(mode.options) if wrapper is mode.wrapper else {}
    options.update(wrapper_options)
    return wrapper(model, batch_first=batch_first, loss_reduction=loss_reduction, **options)
