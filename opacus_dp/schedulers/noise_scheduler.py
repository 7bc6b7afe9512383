"""Schedules of the noise multiplier ``optimizer.noise_multiplier`` (σ), with the classes and
arguments of Opacus's ``opacus.schedulers`` (see :mod:`opacus_dp.schedulers.base` for the
protocol). Call ``step()`` once per epoch (or whatever period you choose), like torch's LR
schedulers; the constructor sets epoch 0.
"""

from typing import Callable

from opacus_dp.schedulers.base import OptimizerValueScheduler, check_step_size


class _NoiseScheduler(OptimizerValueScheduler):
    """Base of the noise-multiplier schedules: implement ``factor(epoch)`` (or ``get_noise_multiplier()``)."""

    attribute = "noise_multiplier"

    def get_noise_multiplier(self):
        """The value for epoch ``last_epoch``; a subclass may override this instead of ``factor``."""
        return OptimizerValueScheduler.scheduled_value(self)

    def scheduled_value(self):
        return self.get_noise_multiplier()


class ExponentialNoise(_NoiseScheduler):
    """``σ_e = γ · σ_(e-1)`` for ``e ≥ 1`` (factors accumulate: γ < 1 shrinks σ)."""

    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return 1.0 if epoch == 0 else self.gamma


class StepNoise(_NoiseScheduler):
    """``σ`` times γ every ``step_size`` epochs (at epochs ``step_size``, ``2·step_size``, ...)."""

    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        self.step_size = check_step_size(step_size)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.gamma if epoch > 0 and epoch % self.step_size == 0 else 1.0


class LambdaNoise(_NoiseScheduler):
    """``σ_e = noise_lambda(e) · σ_base``, ``σ_base`` the value at construction (factors do
    not accumulate)."""

    relative_to_base = True

    def __init__(self, optimizer, *, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        if not callable(noise_lambda):
            raise TypeError(f"noise_lambda must be a function of the epoch, got {type(noise_lambda).__name__}")
        self.noise_lambda = noise_lambda
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.noise_lambda(epoch)
