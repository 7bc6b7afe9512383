"""Schedules of the clipping bound ``optimizer.max_grad_norm`` (C; per-layer bounds alike), with
the classes and arguments of Opacus's ``opacus.schedulers`` (see :mod:`opacus_dp.schedulers.base` for the
protocol). Call ``step()`` once per epoch (or whatever period you choose), like torch's LR
schedulers; the constructor sets epoch 0.
"""

from typing import Callable

from opacus_dp.schedulers.base import OptimizerValueScheduler
from opacus_dp.schedulers.rules import ExponentialRule, LambdaRule, StepRule


class _GradClipScheduler(OptimizerValueScheduler):
    """Base of the clipping-bound schedules: implement ``factor(epoch)`` (or ``get_max_grad_norm()``)."""

    attribute = "max_grad_norm"

    def get_max_grad_norm(self):
        """The value for epoch ``last_epoch``; a subclass may override this instead of ``factor``."""
        return OptimizerValueScheduler.scheduled_value(self)

    def scheduled_value(self):
        return self.get_max_grad_norm()


class ExponentialGradClip(ExponentialRule, _GradClipScheduler):
    """``C_e = γ · C_(e-1)`` for ``e ≥ 1`` (arguments ``gamma``, ``last_epoch``)."""


class StepGradClip(StepRule, _GradClipScheduler):
    """``C`` times γ every ``step_size`` epochs (arguments ``step_size``, ``gamma``, ``last_epoch``)."""


class LambdaGradClip(LambdaRule, _GradClipScheduler):
    """``C_e = scheduler_function(e) · C_base``, ``C_base`` the value at construction."""

    function_attribute = "scheduler_function"

    def __init__(self, optimizer, *, scheduler_function: Callable[[int], float], last_epoch: int = -1):
        self._keep_function(scheduler_function)
        super().__init__(optimizer, last_epoch=last_epoch)
