"""Schedules of the noise multiplier ``optimizer.noise_multiplier`` (σ), with the classes and
arguments of Opacus's ``opacus.schedulers`` (see :mod:`opacus_dp.schedulers.base` for the
protocol). Call ``step()`` once per epoch (or whatever period you choose), like torch's LR
schedulers; the constructor sets epoch 0.
"""

from typing import Callable

from opacus_dp.schedulers.base import OptimizerValueScheduler
from opacus_dp.schedulers.rules import ExponentialRule, LambdaRule, StepRule


class _NoiseScheduler(OptimizerValueScheduler):
    """Base of the noise-multiplier schedules: implement ``factor(epoch)`` (or ``get_noise_multiplier()``)."""

    attribute = "noise_multiplier"

    def get_noise_multiplier(self):
        """The value for epoch ``last_epoch``; a subclass may override this instead of ``factor``."""
        return OptimizerValueScheduler.scheduled_value(self)

    def scheduled_value(self):
        return self.get_noise_multiplier()


class ExponentialNoise(ExponentialRule, _NoiseScheduler):
    """``σ_e = γ · σ_(e-1)`` for ``e ≥ 1`` (arguments ``gamma``, ``last_epoch``)."""


class StepNoise(StepRule, _NoiseScheduler):
    """``σ`` times γ every ``step_size`` epochs (arguments ``step_size``, ``gamma``, ``last_epoch``)."""


class LambdaNoise(LambdaRule, _NoiseScheduler):
    """``σ_e = noise_lambda(e) · σ_base``, ``σ_base`` the value at construction."""

    function_attribute = "noise_lambda"

    def __init__(self, optimizer, *, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        self._keep_function(noise_lambda)
        super().__init__(optimizer, last_epoch=last_epoch)
