"""Opacus 0.x's ``attach``: the private methods installed on the optimizer instance
(``step``, ``zero_grad``, ``virtual_step``, ``signal_skip_step``) and their exact removal."""

import types
from typing import Dict

import torch

from opacus_dp.optim.amp_scaling import copy_found_inf

PATCHED_ATTRIBUTES = ("step", "zero_grad", "virtual_step", "signal_skip_step", "privacy_engine",
                      "_step_supports_amp_scaling")
_MISSING = object()


def _dp_step(optimizer, closure=None, grad_scaler=None):
    """The private step; with a ``torch.amp.GradScaler`` (which keys its state by the patched
    ``optimizer``) the scaler's ``found_inf`` is the one the private step gave back."""
    engine = optimizer.privacy_engine
    feed = getattr(engine, "_sampler_feed", None)
    if feed is not None:  # Opacus 0.14's sampler, recognised at attach
        feed.check(engine.steps)
    dp_optimizer = engine._dp_optimizer
    if grad_scaler is None:
        return dp_optimizer.step(closure)
    result = dp_optimizer.step(closure, grad_scaler=grad_scaler)
    copy_found_inf(grad_scaler, dp_optimizer, optimizer)
    return result


def _dp_zero_grad(optimizer, set_to_none: bool = True):
    optimizer.privacy_engine._dp_optimizer.zero_grad(set_to_none)


def _dp_virtual_step(optimizer):
    optimizer.privacy_engine._dp_optimizer.virtual_step()


def _dp_signal_skip_step(optimizer, do_skip: bool = True):
    optimizer.privacy_engine._dp_optimizer.signal_skip_step(do_skip)


def _marked_as_scheduler_wrapped(optimizer):
    """Private step carrying the mark of torch's LR-scheduler wrapper it replaces.

    The wrapped original (called inside the private step) still records the call for the
    scheduler, so the scheduler need not warn that ``step`` was overridden.
    """
    def step(closure=None, grad_scaler=None):
        return _dp_step(optimizer, closure, grad_scaler)

    step._wrapped_by_lr_sched = True
    return step


def patch_optimizer(optimizer: torch.optim.Optimizer, engine) -> Dict[str, object]:
    """Install the private methods on the ``optimizer`` instance; return what they replaced."""
    saved = {name: optimizer.__dict__.get(name, _MISSING) for name in PATCHED_ATTRIBUTES}
    previous_step = optimizer.step
    optimizer.privacy_engine = engine
    optimizer.step = types.MethodType(_dp_step, optimizer)
    if getattr(previous_step, "_wrapped_by_lr_sched", False):
        optimizer.step = _marked_as_scheduler_wrapped(optimizer)
    optimizer.zero_grad = types.MethodType(_dp_zero_grad, optimizer)
    optimizer.virtual_step = types.MethodType(_dp_virtual_step, optimizer)
    optimizer.signal_skip_step = types.MethodType(_dp_signal_skip_step, optimizer)
    optimizer._step_supports_amp_scaling = True  # a GradScaler hands itself to the private step
    return saved


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: Dict[str, object]) -> None:
    """Undo :func:`patch_optimizer` exactly (instance attributes removed or restored)."""
    for name, value in saved.items():
        if value is _MISSING:
            optimizer.__dict__.pop(name, None)
        else:
            setattr(optimizer, name, value)
