"""Opacus 1.x's optimizer functions: ``params(optimizer)`` (``opacus.optimizers.utils``) and the
noise draw ``_generate_noise`` of ``opacus.optimizers.optimizer``."""

from typing import List, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer

from opacus_dp.optim.noise import GaussianNoise


def params(optimizer: Optimizer) -> List[nn.Parameter]:
    """The parameters of ``optimizer`` (all its param groups) that require a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def generate_noise(std: float, reference: torch.Tensor, generator: Optional[torch.Generator] = None,
                   secure_mode: bool = False) -> torch.Tensor:
    """Noise with i.i.d. ``N(0, std²)`` entries shaped like ``reference`` (zeros for std = 0)."""
    noise = GaussianNoise(generator=generator, secure_mode=secure_mode)
    noise.begin_step(reference.device)
    return noise.sample(reference, std)


__all__ = ["generate_noise", "params"]
