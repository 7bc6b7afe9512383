"""Validate / fix one recurrent layer (``nn.RNN``/``nn.LSTM``/``nn.GRU`` → the DP layer of the
same kind with the same weights): the functions behind Opacus 1.x's ``opacus.validators.lstm``
and ``opacus.validators.gru``.

The checks themselves are ``ModuleValidator``'s rules (:mod:`opacus_dp.validators.rules`); these
functions apply them to one module (path ``model``).
"""

from typing import List

import torch.nn as nn

from opacus_dp.validators.module_errors import UnsupportedModuleError
from opacus_dp.validators.fixers import recurrent_to_dp
from opacus_dp.validators.module_validator import ROOT_NAME
from opacus_dp.validators.rules import check_recurrent


def validate(module: nn.Module) -> List[UnsupportedModuleError]:
    """The problems of ``module`` itself (an empty list when it is fine)."""
    problem = check_recurrent(module)
    return [] if problem is None else [problem.error(ROOT_NAME, module)]


def fix(module: nn.Module, **_opacus_options) -> nn.Module:
    """The DP layer of ``module``'s kind (``DPLSTM``, ``DPGRU``, ``DPRNN``) with the same weights."""
    return recurrent_to_dp(module)
