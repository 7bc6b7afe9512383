"""Schedules of the clipping bound (each per-layer bound alike) ``optimizer.max_grad_norm`` (C), with the classes and
arguments of Opacus's ``opacus.schedulers`` (see :mod:`opacus_dp.schedulers.base` for the
protocol). Call ``step()`` once per epoch (or whatever period you choose), like torch's LR
schedulers; the constructor sets epoch 0.
"""

from typing import Callable

from opacus_dp.schedulers.base import OptimizerValueScheduler, check_step_size


class _GradClipScheduler(OptimizerValueScheduler):
    """Base of the clipping-bound schedules: implement ``factor(epoch)`` (or ``get_max_grad_norm()``)."""

    attribute = "max_grad_norm"

    def get_max_grad_norm(self):
        """The value for epoch ``last_epoch``; a subclass may override this instead of ``factor``."""
        return OptimizerValueScheduler.scheduled_value(self)

    def scheduled_value(self):
        return self.get_max_grad_norm()


class ExponentialGradClip(_GradClipScheduler):
    """``C_e = γ · C_(e-1)`` for ``e ≥ 1`` (factors accumulate: γ < 1 shrinks C)."""

    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return 1.0 if epoch == 0 else self.gamma


class StepGradClip(_GradClipScheduler):
    """``C`` times γ every ``step_size`` epochs (at epochs ``step_size``, ``2·step_size``, ...)."""

    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        self.step_size = check_step_size(step_size)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.gamma if epoch > 0 and epoch % self.step_size == 0 else 1.0


class LambdaGradClip(_GradClipScheduler):
    """``C_e = scheduler_function(e) · C_base``, ``C_base`` the value at construction (factors do
    not accumulate)."""

    relative_to_base = True

    def __init__(self, optimizer, *, scheduler_function: Callable[[int], float], last_epoch: int = -1):
        if not callable(scheduler_function):
            raise TypeError(f"scheduler_function must be a function of the epoch, got {type(scheduler_function).__name__}")
        self.scheduler_function = scheduler_function
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.scheduler_function(epoch)
