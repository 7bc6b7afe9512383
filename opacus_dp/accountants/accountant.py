"""Base class of the privacy accountants: the privacy history as data.

An accountant records one event ``(noise_multiplier σ, sample_rate q)`` per optimizer step.
Consecutive equal events are merged, so ``history`` is a list of ``(σ, q, num_steps)``
segments; a noise schedule or a changed batch size simply starts a new segment.  The
history is serialisable with ``state_dict``/``load_state_dict`` (layout compatible with
Opacus 1.x: keys ``"history"`` and ``"mechanism"``).  Accountants know nothing about
optimizers; :meth:`get_optimizer_hook_fn` only reads ``optimizer.noise_multiplier``.
"""

import abc
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from opacus_dp.accountants.validation import check_noise_multiplier, check_sample_rate, check_steps

HistoryEntry = Tuple[float, float, int]  # (noise_multiplier, sample_rate, num_steps)


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
    """Records (σ, q) per step and converts the history into an (ε, δ) guarantee."""

    def __init__(self) -> None:
        self.history: List[HistoryEntry] = []

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step of the sampled Gaussian mechanism with noise σ and sample rate q."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + 1)
        else:
            self.history.append((sigma, q, 1))

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """ε spent so far at the given δ (``inf`` when no finite ε holds)."""

    def get_privacy_spent(self, *, delta: float) -> Tuple[float, Optional[float]]:
        """``(ε, None)``; the RDP accountant returns ``(ε, best_order)`` instead."""
        return self.get_epsilon(delta), None

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
        return destination

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Replace the history by the one in ``state_dict``. The history — (σ, q, steps)
        records — does not depend on the accountant, so another mechanism's state loads too (as
        in Opacus), with a warning that ε is now computed by this one."""
        if not state_dict or "history" not in state_dict or "mechanism" not in state_dict:
            raise ValueError("state_dict must contain the keys 'history' and 'mechanism'")
        history = validate_history(state_dict["history"])
        if state_dict["mechanism"] != self.mechanism():
            warnings.warn(
                f"loading the history of a {state_dict['mechanism']!r} accountant into a "
                f"{self.mechanism()!r} accountant: the same steps, with epsilon computed by "
                f"{self.mechanism()!r} from now on", UserWarning, stacklevel=2)
        self.history = history

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A hook ``fn(optimizer)`` that records one step with ``optimizer.noise_multiplier``.

        The recorded sample rate is ``sample_rate × optimizer.accumulated_iterations`` when the
        optimizer reports accumulated iterations (several batches merged into one step), else
        ``sample_rate``.
        """
        check_sample_rate(sample_rate)

        def hook_fn(optimizer) -> None:
            iterations = getattr(optimizer, "accumulated_iterations", 1)
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=min(1.0, sample_rate * iterations))

        return hook_fn

    def _spends_nothing(self) -> bool:
        return all(q == 0.0 or steps == 0 for _, q, steps in self.history)

    def _spends_everything(self) -> bool:
        return any(sigma == 0.0 and q > 0.0 and steps > 0 for sigma, q, steps in self.history)


IAccountant = PrivacyAccountant  # name used by Opacus 1.x
