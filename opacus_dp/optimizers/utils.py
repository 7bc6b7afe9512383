"""Opacus 1.x ``opacus.optimizers.utils``."""

from typing import List

import torch.nn as nn
from torch.optim import Optimizer


def params(optimizer: Optimizer) -> List[nn.Parameter]:
    """The parameters of ``optimizer`` (all its param groups) that require a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


__all__ = ["params"]
