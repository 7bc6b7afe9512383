"""What the noise and clipping-bound schedulers share: torch's LR-scheduler protocol applied
to one value of a :class:`~opacus_dp.optim.DPOptimizer`.

Every ``step()`` advances ``last_epoch`` by one and sets the value to

    v_e = factor(e) · v_{e-1}    (``relative_to_base = False``: factors accumulate), or
    v_e = factor(e) · v_base     (``relative_to_base = True``: ``v_base`` the value at construction);

the constructor takes the first step (``last_epoch`` -1 → 0), as torch's schedulers do. Per-layer
clipping bounds are scaled together (each bound times the factor), which keeps their ratios.

``state_dict()`` holds the schedule's counters and the value last set, without the optimizer
and without plain functions (which ``torch.save`` cannot pickle; pass the same function again
when resuming, as with ``torch.optim.lr_scheduler.LambdaLR``); ``load_state_dict`` sets the
value again, so a resumed run continues from the scheduled value, not the constructor's.
The accountant records the noise multiplier of each step, so any schedule is accounted exactly.
Correlated noise (``noise_mechanism`` other than ``independent``) refuses a step whose σ or bound changed.
"""

import types
from typing import Any, Dict, List, Union

from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

Value = Union[float, List[float]]


class OptimizerValueScheduler:
    """Base class: subclasses set ``attribute``, ``relative_to_base`` and :meth:`factor`."""

    attribute = ""
    relative_to_base = False

    def __init__(self, optimizer, *, last_epoch: int = -1):
        self._given = optimizer  # a classic engine's optimizer: the private step behind it may change
        optimizer = dp_optimizer_behind(optimizer) or optimizer  # also Opacus's optimizers
        if not hasattr(optimizer, self.attribute):
            raise ValueError(
                f"{type(self).__name__} needs an optimizer with a .{self.attribute} attribute: pass "
                "the DPOptimizer returned by make_private, or (classic API) the optimizer given to "
                "PrivacyEngine.attach after attaching")
        self.optimizer = optimizer
        self.last_epoch = int(last_epoch)
        self.base_value = self._read()
        self.step()

    def factor(self, epoch: int) -> float:
        """The multiplier applied at ``epoch`` (see the module doc)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither factor(epoch) nor its own "
                                  "scheduled value (both are abstract in the base class)")

    def step(self) -> None:
        self.last_epoch += 1
        self._write(self.scheduled_value())

    def scheduled_value(self) -> Value:
        """The value for epoch ``last_epoch`` (subclasses with their own rule override this)."""
        start = self.base_value if self.relative_to_base else self._read()
        return _scaled(start, self.factor(self.last_epoch))

    def current_value(self) -> Value:
        """The scheduled value now (a list of bounds for per-layer clipping)."""
        return self._read()

    def state_dict(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("optimizer", "_given") and not isinstance(v, (types.FunctionType, types.LambdaType))}
        state["value"] = self._read()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state = dict(state_dict)
        value = state.pop("value", None)
        if value is not None:
            self._check_same_kind(value)
        self.__dict__.update(state)
        if value is not None:
            self._write(value)

    def _check_same_kind(self, value: Value) -> None:
        """A saved list of per-layer bounds only fits an optimizer clipping per layer (and a
        number only one clipping flat): loading would switch the clipping mode silently."""
        saved = "per-layer" if isinstance(value, (list, tuple)) else "flat"
        current = "per-layer" if isinstance(self._read(), list) else "flat"
        if saved != current:
            raise ValueError(
                f"{type(self).__name__}: the saved schedule is for {saved} clipping but this "
                f"optimizer clips {current}; build the run as it was saved (nothing was loaded)")

    def _target(self):
        """The optimizer whose value is scheduled: after a classic engine's ``detach`` and
        ``attach``, the private step attached now."""
        self.optimizer = dp_optimizer_behind(self._given) or self.optimizer
        return self.optimizer

    def _read(self) -> Value:
        optimizer = self._target()
        if self.attribute == "max_grad_norm" and _clips_per_layer(optimizer):
            return list(optimizer.max_grad_norms)
        return getattr(optimizer, self.attribute)

    def _write(self, value: Value) -> None:
        optimizer = self._target()
        if isinstance(value, (list, tuple)):
            optimizer.max_grad_norms = list(value)
        else:
            setattr(optimizer, self.attribute, value)


def _clips_per_layer(optimizer) -> bool:
    return type(getattr(optimizer, "clipper", None)).__name__ == "PerLayerClipper"


def _scaled(value: Value, factor: float) -> Value:
    if isinstance(value, (list, tuple)):
        return [v * factor for v in value]
    return value * factor


def check_step_size(step_size) -> int:
    if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
        raise ValueError(f"step_size must be a positive integer (epochs between changes), got {step_size!r}")
    return step_size
