"""The three schedule rules, shared by the noise and the clipping-bound schedules (mixed in
before :class:`~opacus_dp.schedulers.base.OptimizerValueScheduler`; ``v`` is σ or C)."""

from typing import Callable

from opacus_dp.schedulers.base import check_step_size


class ExponentialRule:
    """``v_e = γ · v_(e-1)`` for ``e ≥ 1`` (factors accumulate: γ < 1 shrinks ``v``)."""

    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return 1.0 if epoch == 0 else self.gamma


class StepRule:
    """``v`` times γ every ``step_size`` epochs (at epochs ``step_size``, ``2·step_size``, ...)."""

    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        self.step_size = check_step_size(step_size)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def factor(self, epoch: int) -> float:
        return self.gamma if epoch > 0 and epoch % self.step_size == 0 else 1.0


class LambdaRule:
    """``v_e = f(e) · v_base``, ``v_base`` the value at construction (factors do not accumulate);
    ``f`` is kept in the attribute named ``function_attribute`` (Opacus's argument name)."""

    relative_to_base = True
    function_attribute = ""

    def _keep_function(self, function: Callable[[int], float]) -> None:
        if not callable(function):
            raise TypeError(f"{self.function_attribute} must be a function of the epoch, "
                            f"got {type(function).__name__}")
        setattr(self, self.function_attribute, function)

    def factor(self, epoch: int) -> float:
        return getattr(self, self.function_attribute)(epoch)
