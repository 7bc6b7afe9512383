"""Opacus 1.x's ``opacus.validators.batch_norm``: validate / fix a BatchNorm (fixed: GroupNorm, or InstanceNorm).

The checks themselves are ``ModuleValidator``'s rules (:mod:`opacus_dp.validators.rules`); these
functions apply them to one module (path ``model``).
"""

from typing import List

import torch.nn as nn

from opacus_dp.validators.errors import UnsupportedModuleError
from opacus_dp.validators.fixers import batchnorm_to_groupnorm, batchnorm_to_instancenorm
from opacus_dp.validators.module_validator import ROOT_NAME
from opacus_dp.validators.rules import check_batch_norm

BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
INSTANCENORM = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def validate(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of ``module`` itself (an empty list when it is fine)."""
    problem = check_batch_norm(module)
    return [] if problem is None else [problem.error(ROOT_NAME, module)]


def fix(module: nn.Module, *, replace_bn_with_in: bool = False, num_groups=None) -> nn.Module:
    """GroupNorm(``num_groups`` or gcd(32, C), C) with the affine weights, or with
    ``replace_bn_with_in=True`` the InstanceNorm of the same dimensionality (Opacus's arguments)."""
    if replace_bn_with_in and num_groups is not None:
        raise ValueError("num_groups and replace_bn_with_in=True are mutually exclusive: choose one norm")
    if replace_bn_with_in:
        return batchnorm_to_instancenorm(module)
    return batchnorm_to_groupnorm(module, num_groups=num_groups)
