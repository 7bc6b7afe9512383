"""Exponential moving average (EMA) of a model's parameters, for evaluation.

After the t-th update of the parameters θ (t = 0, 1, 2, ... counts the updates averaged before),

    θ̄ ← β_t · θ̄ + (1 − β_t) · θ,        β_t = min(D, (1 + t) / (10 + t)),

starting from θ̄ = the initial parameters. ``D`` is the decay; the warm-up ``(1 + t)/(10 + t)``
(0.1, 0.18, 0.25, ... → 1) lets the average forget the random initialisation quickly, and
while it is below D the average weighs roughly the last tenth of the steps. With D = 0.999, the
coefficient of the public JAX Privacy configuration of the CIFAR-10 WRN-16-4 recipe of De et al. 2022
(arXiv:2204.13650), the warm-up governs for the first ~9000 steps. The EMA is computed from the parameters
the private optimizer already released, so it costs no privacy (post-processing).

:class:`EMAModel` holds the averages as buffers beside the trained network (so checkpoints and
``--resume`` keep them); its forward uses the network's own parameters in training mode and the
averages in evaluation mode. :func:`updated_after_steps` updates the averages after every step of
an optimizer that trains the network.
"""

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.optim.optimizer import register_optimizer_step_post_hook


def ema_decay(decay: float, t: int) -> float:
    """β_t = min(D, (1 + t)/(10 + t)) of the module doc (t = updates already averaged)."""
    return min(decay, (1.0 + t) / (10.0 + t))


class EMAModel(nn.Module):
    """``net`` with an EMA of its trainable parameters (module doc); ``decay`` D in [0, 1).

    State dict: ``net.*`` (the trained weights), ``averages.average_<i>`` (θ̄ of the i-th
    trainable parameter of ``net``, in ``named_parameters`` order) and ``updates`` (t).
    """

    def __init__(self, net: nn.Module, decay: float):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1), got {decay}")
        self.net = net
        self.decay = float(decay)
        self.names = [name for name, p in net.named_parameters() if p.requires_grad]
        self.averages = nn.Module()
        for i, p in enumerate(self._trained()):
            self.averages.register_buffer(f"average_{i}", p.detach().clone())
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def _trained(self):
        return [p for p in self.net.parameters() if p.requires_grad]

    def averaged_parameters(self) -> Dict[str, torch.Tensor]:
        """``{name in net: θ̄}``."""
        return dict(zip(self.names, self.averages.buffers()))

    @torch.no_grad()
    def update(self) -> None:
        """One EMA update from the current parameters (module doc)."""
        beta = ema_decay(self.decay, int(self.updates))
        for average, p in zip(self.averages.buffers(), self._trained()):
            average.mul_(beta).add_(p.detach().to(average.dtype), alpha=1.0 - beta)
        self.updates += 1

    def forward(self, *args, **kwargs):
        if self.training:
            return self.net(*args, **kwargs)
        return functional_call(self.net, self.averaged_parameters(), args, kwargs)

    @contextmanager
    def averaged(self) -> Iterator[nn.Module]:
        """Within the block ``net``'s parameters hold the averages θ̄ (to evaluate or export the
        plain network); afterwards the trained values are restored exactly."""
        trained = [p.detach().clone() for p in self._trained()]
        try:
            with torch.no_grad():
                for p, average in zip(self._trained(), self.averages.buffers()):
                    p.copy_(average)
            yield self.net
        finally:
            with torch.no_grad():
                for p, saved in zip(self._trained(), trained):
                    p.copy_(saved)


def _trains(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> bool:
    return any(p is parameter for group in optimizer.param_groups for p in group["params"])


@contextmanager
def updated_after_steps() -> Iterator[Callable[[nn.Module], nn.Module]]:
    """Yield ``track(model) -> model``: within the block, every completed ``step()`` of a
    ``torch.optim`` optimizer that trains the ``net`` of a tracked :class:`EMAModel` is followed by
    that model's :meth:`~EMAModel.update` (one global step post-hook, removed at exit; models of
    another type pass through untracked).

    With a private optimizer the hook runs after the inner optimizer's update: once per released
    (noised) step, never for a piece of a logical batch, nor for a refused or skipped step.
    """
    tracked: List[Tuple[torch.Tensor, EMAModel]] = []

    def hook(optimizer, args, kwargs):
        for anchor, model in tracked:
            if _trains(optimizer, anchor):
                model.update()

    def track(model: nn.Module) -> nn.Module:
        if isinstance(model, EMAModel):
            tracked.append((next(p for p in model.net.parameters() if p.requires_grad), model))
        return model

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield track
    finally:
        handle.remove()
