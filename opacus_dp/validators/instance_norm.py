"""Opacus 1.x's ``opacus.validators.instance_norm``: validate / fix an InstanceNorm (fixed: without running statistics).

The checks themselves are ``ModuleValidator``'s rules (:mod:`opacus_dp.validators.rules`); these
functions apply them to one module (path ``model``).
"""

from typing import List

import torch.nn as nn

from opacus_dp.validators.errors import UnsupportedModuleError
from opacus_dp.validators.fixers import instancenorm_without_running_stats
from opacus_dp.validators.module_validator import ROOT_NAME
from opacus_dp.validators.rules import check_instance_norm

INSTANCENORM = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def validate(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of ``module`` itself (an empty list when it is fine)."""
    problem = check_instance_norm(module)
    return [] if problem is None else [problem.error(ROOT_NAME, module)]


def fix(module: nn.Module, **_opacus_options) -> nn.Module:
    """The same InstanceNorm with ``track_running_stats=False``."""
    return instancenorm_without_running_stats(module)
