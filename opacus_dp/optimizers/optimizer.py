"""Opacus 1.x path `opacus.optimizers.optimizer` (compatibility): :class:`DPOptimizer` and
``_generate_noise`` (one ``N(0, std²)`` draw shaped like ``reference``)."""

from typing import Optional

import torch

from opacus_dp.optim.noise import GaussianNoise
from opacus_dp.optimizers import DPOptimizer

__all__ = ["DPOptimizer"]


def _generate_noise(std: float, reference: torch.Tensor, generator: Optional[torch.Generator] = None,
                    secure_mode: bool = False) -> torch.Tensor:
    """Noise with i.i.d. ``N(0, std²)`` entries shaped like ``reference`` (zeros for std = 0)."""
    noise = GaussianNoise(generator=generator, secure_mode=secure_mode)
    noise.begin_step(reference.device)
    return noise.sample(reference, std)
