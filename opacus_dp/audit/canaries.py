"""Dirac gradient canaries: examples whose gradient is a scaled unit vector only they touch.

White-box setting of Nasr et al. 2023, "Tight Auditing of Differentially Private Machine
Learning": the auditor controls one example's gradient and sees every model update. Here the
model is a bias-free linear layer ``f(x) = w·x`` on ``d_b + m`` input features and the loss of an
example ``(x, y)`` is ``ℓ = −y·f(x)``, so its gradient is ``−y·x`` whatever ``w`` is:

* background example: ``x`` Gaussian on the first ``d_b`` features (norm well above C, so it is
  clipped), ``y = ±1``; it never touches a canary coordinate;
* canary i: ``x = s·C·e_{d_b+i}``, ``y = +1``; its gradient has norm ``s·C ≥ C`` on coordinate
  ``d_b + i`` alone, so after clipping it adds exactly ``C`` (up to the clipper's 1e-6 guard)
  to that coordinate, and nobody else does.

With learning rate η, divisor ``D`` (the expected batch size for a mean loss, 1 for a sum) and
noise multiplier σ, one SGD step moves ``w_{d_b+i}`` by ``η/D · (C·b_i,t + N(0, σ²C²))`` where
``b_i,t`` says whether canary i was in that step's batch. The canary examples come first in the
dataset (present ones only: an absent canary is removed, i.e. add/remove adjacency).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

BACKGROUND_SCALE = 3.0  # background inputs ~ N(0, 9): norm ≈ 3·√d_b, clipped for C ≲ 3√d_b


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class CanaryLayout:
    """Sizes of the canary task: ``num_canaries`` (m), background examples and their features (d_b).

    ``gradient_scale`` s ≥ 1 is the canary's gradient norm in units of the clipping bound C.
    """

    num_canaries: int
    num_background: int = 32
    background_dim: int = 8
    gradient_scale: float = 4.0

    def __post_init__(self):
        _positive_int(self.num_canaries, "num_canaries")
        _positive_int(self.background_dim, "background_dim")
        if isinstance(self.num_background, bool) or not isinstance(self.num_background, int) \
                or self.num_background < 0:
            raise ValueError(f"num_background must be an int ≥ 0, got {self.num_background!r}")
        if not isinstance(self.gradient_scale, (int, float)) or not self.gradient_scale >= 1.0:
            raise ValueError(
                f"gradient_scale must be ≥ 1 (the canary's gradient norm in units of max_grad_norm, "
                f"so that clipping scales it to exactly max_grad_norm), got {self.gradient_scale!r}"
            )

    @property
    def input_dim(self) -> int:
        return self.background_dim + self.num_canaries

    @property
    def canary_coordinates(self) -> slice:
        """Indices of the canary coordinates in the weight row of the model."""
        return slice(self.background_dim, self.input_dim)


def draw_membership(num_canaries: int, generator: torch.Generator) -> torch.Tensor:
    """``(m,)`` bool: each canary is included independently with probability 1/2."""
    return torch.rand(_positive_int(num_canaries, "num_canaries"), generator=generator) < 0.5


def canary_dataset(layout: CanaryLayout, membership: torch.Tensor, *, max_grad_norm: float,
                   generator: torch.Generator, dtype: torch.dtype = torch.float64) -> TensorDataset:
    """Present canaries first (in index order), then the background examples (see module doc)."""
    membership = torch.as_tensor(membership, dtype=torch.bool)
    if membership.shape != (layout.num_canaries,):
        raise ValueError(f"membership must have shape ({layout.num_canaries},), got {tuple(membership.shape)}")
    present = membership.nonzero().view(-1)
    canaries = torch.zeros(len(present), layout.input_dim, dtype=dtype)
    canaries[torch.arange(len(present)), layout.background_dim + present] = \
        layout.gradient_scale * float(max_grad_norm)
    background = torch.zeros(layout.num_background, layout.input_dim, dtype=dtype)
    background[:, : layout.background_dim] = BACKGROUND_SCALE * torch.randn(
        layout.num_background, layout.background_dim, generator=generator, dtype=dtype)
    signs = torch.randint(0, 2, (layout.num_background,), generator=generator).to(dtype) * 2 - 1
    targets = torch.cat([torch.ones(len(present), dtype=dtype), signs])
    return TensorDataset(torch.cat([canaries, background]), targets)


def canary_model(layout: CanaryLayout, dtype: torch.dtype = torch.float64) -> nn.Linear:
    """The bias-free linear model ``f(x) = w·x`` (zero-initialised; the loss is linear in ``w``)."""
    model = nn.Linear(layout.input_dim, 1, bias=False, dtype=dtype)
    nn.init.zeros_(model.weight)
    return model


class CanaryLoss(nn.Module):
    """``ℓ_i = −y_i · f(x_i)``, reduced like torch losses (``reduction`` "mean", "sum" or "none").

    The mean of an empty batch is 0 (a Poisson batch may be empty).
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = -(targets * outputs.reshape(-1))
        if self.reduction == "none":
            return losses
        if self.reduction == "sum" or losses.numel() == 0:
            return losses.sum()
        return losses.mean()
