"""Normalisation layers with running statistics, checked at every recorded forward call.

**Frozen BatchNorm: allowed only while it normalises with its running statistics.**

A BatchNorm without trainable parameters (frozen, or ``affine=False``) has no gradient to clip,
so validation lets it through (as Opacus). But in training mode — or without running
statistics, also in eval mode — it normalises every sample with the *batch's* mean and
variance: each output, and so every other layer's per-sample gradient, depends on the other
samples (one sample's presence moves all of them, beyond what clipping bounds), and the running
statistics are updated from the batch without noise. Opacus lets both happen silently.

So before every forward call that the wrapper records, each BatchNorm of the model must use its
running statistics (``eval()`` with ``track_running_stats=True``) and have no trainable
parameter (one made trainable after wrapping has no per-sample gradients).

**InstanceNorm with** ``track_running_stats=True`` normalises each sample on its own, but in
training mode it updates its running statistics from the batch without noise: refused there
(``ModuleValidator`` refuses the layer outright; this covers wrappers built directly).
"""

from typing import Callable, List

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample.support import describe
from opacus_dp.module_parameters import has_trainable_parameters


def needs_replacement(module: _BatchNorm) -> bool:
    """True for a BatchNorm that can never be private as it is: trainable, or without running
    statistics (it then normalises with the batch's in every mode)."""
    return has_trainable_parameters(module) or module.running_mean is None or module.running_var is None


def uses_batch_statistics(module: _BatchNorm) -> bool:
    """True when ``module``'s forward normalises with the batch's statistics (torch's rule)."""
    return module.training or module.running_mean is None or module.running_var is None


def guard_running_statistics(root: nn.Module, recording: Callable[[], bool]) -> List:
    """A forward pre-hook on every BatchNorm and InstanceNorm of ``root`` refusing, while
    ``recording()``, a call that would mix samples or learn statistics without noise (module
    doc); returns the hook handles."""
    handles = []
    for path, module in root.named_modules():
        if isinstance(module, _BatchNorm):
            handles.append(module.register_forward_pre_hook(_batch_norm_checker(path, recording)))
        elif isinstance(module, _InstanceNorm):
            handles.append(module.register_forward_pre_hook(_instance_norm_checker(path, recording)))
    return handles


def _instance_norm_checker(path: str, recording: Callable[[], bool]):
    def check(module: _InstanceNorm, args) -> None:
        if recording() and module.training and module.track_running_stats:
            raise UnsupportedModuleError(
                f"{describe(path, module)} has track_running_stats=True: in training mode it updates "
                "its running statistics from the batch without noise. Build it with "
                "track_running_stats=False (ModuleValidator.fix(model) does this)")
    return check


def _batch_norm_checker(path: str, recording: Callable[[], bool]):
    def check(module: _BatchNorm, args) -> None:
        if not recording():
            return
        if has_trainable_parameters(module):
            raise UnsupportedModuleError(
                f"{describe(path, module)} has trainable parameters: batch normalisation mixes the "
                "samples of a batch, so it has no per-sample gradients; freeze it and call .eval() on "
                "it, or replace it with GroupNorm before making the model private "
                "(ModuleValidator.fix(model))")
        if uses_batch_statistics(module):
            raise UnsupportedModuleError(
                f"{describe(path, module)} is frozen but normalises with the batch's statistics "
                f"({'training mode' if module.training else 'no running statistics'}): every "
                "sample's output would depend on the other samples, and the running statistics "
                "would be updated from the batch without noise. Call .eval() on it after "
                "model.train() (a frozen BatchNorm then applies its running statistics); one without "
                "running statistics never does: replace it with GroupNorm (ModuleValidator.fix(model))")
    return check
