"""Opacus 1.x's per-layer validators (``opacus.validators.batch_norm``, ``.instance_norm``,
``.multihead_attention``): ``validate(module)`` / ``fix(module)`` of one layer type.

The checks themselves are ``ModuleValidator``'s rules (:mod:`opacus_dp.validators.rules`); these
functions apply them to one module (path ``model``). Fixed: a BatchNorm becomes a GroupNorm (or
an InstanceNorm), an InstanceNorm loses its running statistics, an ``nn.MultiheadAttention``
becomes a ``DPMultiheadAttention`` with the same weights.
"""

from typing import List

import torch.nn as nn

from opacus_dp.validators.fixers import (batchnorm_to_groupnorm, batchnorm_to_instancenorm,
                                         instancenorm_without_running_stats, multihead_attention_to_dp)
from opacus_dp.validators.module_errors import UnsupportedModuleError
from opacus_dp.validators.module_validator import ROOT_NAME
from opacus_dp.validators.rules import check_batch_norm, check_instance_norm, check_multihead_attention

BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
INSTANCENORM = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _problems(problem, module: nn.Module) -> List[UnsupportedModuleError]:
    return [] if problem is None else [problem.error(ROOT_NAME, module)]


def validate_batch_norm(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of the BatchNorm ``module`` itself (an empty list when it is fine)."""
    return _problems(check_batch_norm(module), module)


def fix_batch_norm(module: nn.Module, *, replace_bn_with_in: bool = False, num_groups=None) -> nn.Module:
    """GroupNorm(``num_groups`` or gcd(32, C), C) with the affine weights, or with
    ``replace_bn_with_in=True`` the InstanceNorm of the same dimensionality (Opacus's arguments)."""
    if replace_bn_with_in and num_groups is not None:
        raise ValueError("num_groups and replace_bn_with_in=True are mutually exclusive: choose one norm")
    if replace_bn_with_in:
        return batchnorm_to_instancenorm(module)
    return batchnorm_to_groupnorm(module, num_groups=num_groups)


def validate_instance_norm(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of the InstanceNorm ``module`` itself (an empty list when it is fine)."""
    return _problems(check_instance_norm(module), module)


def fix_instance_norm(module: nn.Module, **_opacus_options) -> nn.Module:
    """The same InstanceNorm with ``track_running_stats=False``."""
    return instancenorm_without_running_stats(module)


def validate_multihead_attention(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of the ``nn.MultiheadAttention`` ``module`` itself (an empty list when it is fine)."""
    return _problems(check_multihead_attention(module), module)


def fix_multihead_attention(module: nn.Module, **_opacus_options) -> nn.Module:
    """``opacus_dp.layers.DPMultiheadAttention`` with the same weights."""
    return multihead_attention_to_dp(module)
