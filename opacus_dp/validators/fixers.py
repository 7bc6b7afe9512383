"""Replacements used by ``ModuleValidator.fix``: each takes a module and returns a private-ready one.

Replacements keep device, dtype, training mode, trainable weights (values and ``requires_grad``).
"""

import importlib
import math
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from opacus_dp.validators.module_errors import NotYetSupportedModuleError

MAX_GROUPS = 32  # Wu & He 2018, "Group Normalization": G = 32 is their default group count.
_INSTANCE_NORMS = {
    nn.BatchNorm1d: nn.InstanceNorm1d,
    nn.BatchNorm2d: nn.InstanceNorm2d,
    nn.BatchNorm3d: nn.InstanceNorm3d,
}
_DP_RNN_NAMES = {nn.LSTM: "DPLSTM", nn.GRU: "DPGRU", nn.RNN: "DPRNN"}


def default_num_groups(num_channels: int, max_groups: int = MAX_GROUPS) -> int:
    """``gcd(max_groups, C)`` groups, as Opacus (e.g. 96→32, 48→16, 6→2, 3→1).

    G = 32 of Wu & He (2018) where 32 divides the channel count, else its largest divisor that
    also divides C (GroupNorm needs a divisor); the same count as Opacus, so that a model fixed
    here has the architecture (and takes the checkpoints) of the model Opacus would build.
    """
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    return math.gcd(max_groups, num_channels)


def classic_num_groups(num_channels: int, max_groups: int = MAX_GROUPS) -> int:
    """The largest divisor of C that is ≤ ``max_groups``: Opacus 0.x's ``min(32, C)`` wherever
    that was a divisor (C ≤ 32 or 32 | C), and a valid count where 0.x failed (e.g. 48→24)."""
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    return max(g for g in range(1, min(max_groups, num_channels) + 1) if num_channels % g == 0)


def _factory(module: nn.Module) -> dict:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return {} if tensor is None else {"device": tensor.device, "dtype": tensor.dtype}


def _channel_count(module: nn.Module) -> int:
    if not module.num_features:
        raise ValueError(
            f"{type(module).__name__} has no channel count yet; run one forward pass before fixing it"
        )
    return module.num_features


def _affine(module: nn.Module) -> dict:
    """``affine`` of ``module``, plus ``bias=False`` for an affine norm built without bias."""
    settings = {"affine": module.affine}
    if module.affine and getattr(module, "bias", None) is None:
        settings["bias"] = False
    return settings


def _copy_affine(source: nn.Module, target: nn.Module) -> nn.Module:
    """Copy ``weight``/``bias`` values and ``requires_grad`` flags; copy the training mode."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(source, name, None), getattr(target, name, None)
            if isinstance(src, nn.Parameter) and isinstance(dst, nn.Parameter):
                dst.copy_(src)
                dst.requires_grad_(src.requires_grad)
    return target.train(source.training)


def batchnorm_to_groupnorm(module: _BatchNorm, num_groups: Optional[int] = None) -> nn.GroupNorm:
    """GroupNorm over the same channels (``num_groups`` or ``default_num_groups(C)``), same eps and affine."""
    channels = _channel_count(module)
    groups = default_num_groups(channels) if num_groups is None else num_groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or channels % groups:
        raise ValueError(f"num_groups={num_groups!r} must be a positive divisor of the channel count {channels}")
    replacement = nn.GroupNorm(groups, channels, eps=module.eps, **_affine(module), **_factory(module))
    return _copy_affine(module, replacement)


def batchnorm_to_instancenorm(module: _BatchNorm) -> nn.Module:
    """InstanceNorm of the same dimensionality without affine parameters, the architecture
    Opacus builds (so its checkpoints load); for SyncBatchNorm, which Opacus refuses here,
    ``GroupNorm(C, C)`` (instance norm) keeping the affine weights."""
    channels = _channel_count(module)
    target = _INSTANCE_NORMS.get(type(module))
    if target is None:
        replacement = nn.GroupNorm(channels, channels, eps=module.eps, **_affine(module), **_factory(module))
        return _copy_affine(module, replacement)
    return target(channels, eps=module.eps, **_factory(module)).train(module.training)


def instancenorm_without_running_stats(module: _InstanceNorm) -> _InstanceNorm:
    """The same InstanceNorm with ``track_running_stats=False`` (normalises each sample by itself)."""
    replacement = type(module)(
        _channel_count(module),
        eps=module.eps,
        momentum=module.momentum,
        track_running_stats=False,
        **_affine(module),
        **_factory(module),
    )
    return _copy_affine(module, replacement)


def _dp_layer_class(name: str):
    """``opacus_dp.layers.<name>``, imported on first use (the layers package is optional here)."""
    layer_class = getattr(importlib.import_module("opacus_dp.layers"), name, None)
    if layer_class is None:
        raise NotYetSupportedModuleError(f"opacus_dp.layers.{name} is not available in this installation")
    return layer_class


def _transfer(source: nn.Module, target: nn.Module) -> nn.Module:
    """Load ``source``'s state dict into ``target`` and copy each parameter's ``requires_grad``."""
    target.load_state_dict(source.state_dict())
    target_params = target.state_dict(keep_vars=True)
    for name, param in source.named_parameters():
        counterpart = target_params.get(name)
        if isinstance(counterpart, nn.Parameter):
            counterpart.requires_grad_(param.requires_grad)
        elif not param.requires_grad:
            raise ValueError(
                f"{type(target).__name__} has no parameter {name!r} of its own, so its requires_grad=False "
                "cannot be carried over; unfreeze it before fixing, or freeze the replacement afterwards"
            )
    return target.to(**_factory(source)).train(source.training)


def recurrent_to_dp(module: nn.RNNBase) -> nn.Module:
    """DPLSTM / DPGRU / DPRNN with the same configuration and weights."""
    name = _DP_RNN_NAMES[type(module)]
    settings = dict(
        num_layers=module.num_layers,
        bias=module.bias,
        batch_first=module.batch_first,
        dropout=module.dropout,
        bidirectional=module.bidirectional,
    )
    if module.proj_size:
        settings["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        settings["nonlinearity"] = module.nonlinearity
    replacement = _dp_layer_class(name)(module.input_size, module.hidden_size, **settings,
                                        **_factory(module))
    return _transfer(module, replacement)


def multihead_attention_to_dp(module: nn.MultiheadAttention) -> nn.Module:
    """DPMultiheadAttention with the same configuration and weights."""
    replacement = _dp_layer_class("DPMultiheadAttention")(
        module.embed_dim,
        module.num_heads,
        dropout=module.dropout,
        bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None,
        add_zero_attn=module.add_zero_attn,
        kdim=module.kdim,
        vdim=module.vdim,
        batch_first=module.batch_first,
        **_factory(module),
    )
    return _transfer(module, replacement)
