"""Opacus 1.x's ``opacus.validators.multihead_attention``: validate / fix an nn.MultiheadAttention
(fixed: DPMultiheadAttention).

The checks themselves are ``ModuleValidator``'s rules (:mod:`opacus_dp.validators.rules`); these
functions apply them to one module (path ``model``).
"""

from typing import List

import torch.nn as nn

from opacus_dp.validators.errors import UnsupportedModuleError
from opacus_dp.validators.fixers import multihead_attention_to_dp
from opacus_dp.validators.module_validator import ROOT_NAME
from opacus_dp.validators.rules import check_multihead_attention


def validate(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of ``module`` itself (an empty list when it is fine)."""
    problem = check_multihead_attention(module)
    return [] if problem is None else [problem.error(ROOT_NAME, module)]


def fix(module: nn.Module, **_opacus_options) -> nn.Module:
    """``opacus_dp.layers.DPMultiheadAttention`` with the same weights."""
    return multihead_attention_to_dp(module)
