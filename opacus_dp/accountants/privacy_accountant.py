"""Base class of the privacy accountants: the privacy history as data.

An accountant records one event ``(noise_multiplier σ, sample_rate q)`` per optimizer step.
Consecutive equal events are merged, so ``history`` is a list of ``(σ, q, num_steps)``
segments; a noise schedule or a changed batch size simply starts a new segment.  The
history is serialisable with ``state_dict``/``load_state_dict`` (layout compatible with
Opacus 1.x: keys ``"history"`` and ``"mechanism"``).  Accountants know nothing about
optimizers: they record :class:`~opacus_dp.accountants.events.StepEvent` s, and the hook of
:meth:`get_optimizer_hook_fn` takes the event of each step from
:func:`~opacus_dp.accountants.events.step_event` (σ and merged batches, Opacus's hook contract).
"""

import abc
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

from opacus_dp.accountants.events import StepEvent, step_event
from opacus_dp.accountants.group_privacy import user_level_epsilon
from opacus_dp.accountants.validation import check_noise_multiplier, check_sample_rate, check_steps

HistoryEntry = Tuple[float, float, int]  # (noise_multiplier, sample_rate, num_steps)
T_state_dict = TypeVar("T_state_dict", bound=Mapping[str, Any])  # Opacus 1.x's name


def validate_history(history) -> List[HistoryEntry]:
    """Check a privacy history and return it as a list of ``(σ, q, num_steps)`` tuples."""
    if not isinstance(history, (list, tuple)):
        raise TypeError(f"history must be a list of (noise_multiplier, sample_rate, num_steps), got {history!r}")
    entries = []
    for position, entry in enumerate(history):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"history[{position}] must be (noise_multiplier, sample_rate, num_steps), got {entry!r}")
        sigma = check_noise_multiplier(entry[0], f"history[{position}] noise_multiplier")
        q = check_sample_rate(entry[1], f"history[{position}] sample_rate")
        entries.append((sigma, q, check_steps(entry[2], f"history[{position}] num_steps")))
    return entries


class PrivacyAccountant(abc.ABC):
    """Records (σ, q) per step and converts the history into an (ε, δ) guarantee.

    ``privacy_unit``: what one record's q samples and ε protects, ``"example"`` (default) or
    ``"user"`` (a run sampled by users); one history never mixes the two."""

    privacy_unit = "example"

    def __init__(self) -> None:
        self.history: List[HistoryEntry] = []

    def use_privacy_unit(self, privacy_unit: str) -> None:
        """Record the steps of a run whose unit is ``privacy_unit`` from now on; refused if the
        history already holds steps of another unit (their ε would not compose)."""
        if privacy_unit != self.privacy_unit and self.history:
            raise ValueError(
                f"this accountant's history holds steps per {self.privacy_unit}; a run per {privacy_unit} "
                "cannot add to it (ε of different privacy units do not compose): use a new PrivacyEngine")
        self.privacy_unit = privacy_unit

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step of the sampled Gaussian mechanism with noise σ and sample rate q."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + 1)
        else:
            self.history.append((sigma, q, 1))

    def record(self, event: StepEvent) -> None:
        """Record the ``event.steps`` steps of ``(σ, q)`` of a :class:`StepEvent` (the first
        through :meth:`step`, the others added to the segment it ends in)."""
        steps = check_steps(event.steps)
        if steps:
            self.step(noise_multiplier=event.noise_multiplier, sample_rate=event.sample_rate)
            sigma, q, count = self.history[-1]
            self.history[-1] = (sigma, q, count + steps - 1)

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """ε spent so far at the given δ (``inf`` when no finite ε holds)."""

    def get_privacy_spent(self, *, delta: float) -> Tuple[float, Optional[float]]:
        """``(ε, None)``; the RDP accountant returns ``(ε, best_order)`` instead."""
        return self.get_epsilon(delta), None

    def get_user_level_epsilon(self, delta: float, max_examples_per_user: int, **epsilon_kwargs) -> Tuple[float, float]:
        """``(ε_user, δ')``: the guarantee at ``delta`` for users with at most ``max_examples_per_user``
        examples, by group privacy from this accountant's ε at the example-level δ' (``epsilon_kwargs``
        go to :meth:`get_epsilon`; :func:`~opacus_dp.accountants.group_privacy.user_level_epsilon`)."""
        return user_level_epsilon(lambda delta_example: self.get_epsilon(delta_example, **epsilon_kwargs),
                                  delta, max_examples_per_user)

    def __len__(self) -> int:
        """Total number of recorded steps."""
        return sum(steps for _, _, steps in self.history)

    @classmethod
    @abc.abstractmethod
    def mechanism(cls) -> str:
        """Registry name of the accounting method (``"rdp"``, ``"prv"``, ``"gdp"``)."""

    def state_dict(self, destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The history and the mechanism name (a copy; safe to serialise)."""
        destination = OrderedDict() if destination is None else destination
        destination["history"] = [tuple(entry) for entry in self.history]
        destination["mechanism"] = self.mechanism()
        if self.privacy_unit != "example":
            destination["privacy_unit"] = self.privacy_unit
        return destination

    def load_state_dict(self, state_dict: T_state_dict) -> None:
        """Replace the history by the one in ``state_dict`` (an accountant's :meth:`state_dict`).

        ValueError, as in Opacus, for ``None``/an empty dict, a dict without ``"history"`` or
        ``"mechanism"``, a malformed history, or the state of another mechanism's accountant."""
        if not state_dict:
            raise ValueError("state_dict is None or empty: pass the state_dict() of an accountant")
        missing = [key for key in ("history", "mechanism") if key not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks the key(s) {missing}: pass the state_dict() of an accountant")
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(
                f"state_dict of a {state_dict['mechanism']!r} accountant cannot be loaded into a "
                f"{self.mechanism()!r} accountant: load it into create_accountant("
                f"{state_dict['mechanism']!r}), or, to recompute its steps with {self.mechanism()!r}, "
                "set accountant.history = list(state_dict['history'])")
        saved = state_dict.get("privacy_unit", "example")
        if saved != self.privacy_unit:
            raise ValueError(
                f"state_dict holds a privacy history per {saved!r}, but this accountant records steps per "
                f"{self.privacy_unit!r} (make_private(privacy_unit=...)): one history cannot mix privacy units; "
                f"resume with make_private(..., privacy_unit={saved!r}) before loading")
        self.history = validate_history(state_dict["history"])

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A hook ``fn(optimizer)`` that records the optimizer's :func:`step_event`: σ, and the
        rate ``min(1, k·sample_rate)`` for ``k = optimizer.accumulated_iterations`` batches merged
        into the step (1 if the optimizer does not report it)."""
        check_sample_rate(sample_rate)

        def hook_fn(optimizer) -> None:
            self.record(step_event(optimizer, sample_rate))

        return hook_fn

    def _spends_nothing(self) -> bool:
        return all(q == 0.0 or steps == 0 for _, q, steps in self.history)

    def _spends_everything(self) -> bool:
        return any(sigma == 0.0 and q > 0.0 and steps > 0 for sigma, q, steps in self.history)
