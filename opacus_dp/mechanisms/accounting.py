"""Privacy accounting of the correlated-noise mechanisms, by reduction to events the existing
accountants (PRV, RDP, GDP) analyse.

* ``independent``: DP-SGD, one Poisson subsampled Gaussian ``(σ, q)`` per step.
* ``banded`` with ``b`` bands, data split into ``b`` groups, step ``t`` Poisson-sampling group
  ``t mod b`` at rate ``q_g`` (the engine's cyclic Poisson loader): the amplified analysis of
  Choquette-Choo et al. 2023 (Thm. 4, "(Amplified) Banded Matrix Factorization") shows that with
  the noise ``w ~ N(0, σ² C_clip² ‖c‖²)`` (``‖c‖`` the max column norm) the run is as private as
  ``⌈T/b⌉`` compositions of the Poisson subsampled Gaussian mechanism with noise multiplier
  ``σ`` and rate ``q_g``. Each round of ``b`` steps is recorded as one event ``(σ, q_g)`` at its
  first step and events ``(σ, 0)`` (no cost) at the others, so the history still counts steps.
* ``tree`` and ``blt`` (no amplification analysis is used): noise std ``σ C_clip Δ`` with ``Δ`` the
  sensitivity of ``C`` under the loader's cyclic participation, so the whole run is one Gaussian
  mechanism with noise multiplier ``σ``: ``(σ, 1)`` at the first step, ``(σ, 0)`` afterwards.
  Sampling inside the group does not lower this ε (it is not used).

The step index of the events is the optimizer's ``steps_taken``, the counter the cyclic loader's
:class:`~opacus_dp.data.cyclic_sampler.StepSchedule` reads too: the step charged as step ``t`` of
a round is the step that sampled group ``t mod b``.
"""

import math
from dataclasses import dataclass
from typing import Callable

from opacus_dp.accountants import get_noise_multiplier
from opacus_dp.accountants.events import StepEvent


@dataclass(frozen=True)
class Reduction:
    """Events of a mechanism: every ``round_length``-th step (from step 0) costs ``(σ, rate)``,
    the others nothing; ``round_length = 0``: only step 0 costs (unamplified, whole run)."""

    kind: str
    round_length: int
    rate: float

    def rate_at(self, step: int) -> float:
        """The rate recorded for step ``step`` (0-based): ``rate`` at a round's first step, else 0."""
        first = step == 0 if self.round_length == 0 else step % self.round_length == 0
        return self.rate if first else 0.0

    def event(self, step: int, noise_multiplier: float) -> StepEvent:
        """The event of step ``step`` (0-based)."""
        return StepEvent(noise_multiplier, self.rate_at(step))

    def rounds(self, steps: int) -> int:
        """Costly events among ``steps`` steps: ``⌈T/b⌉`` (1 for a whole-run analysis)."""
        return 1 if self.round_length == 0 else math.ceil(steps / self.round_length)

    def history(self, noise_multiplier: float, steps: int) -> list:
        """The ``(σ, q, steps)`` history the reduction gives for ``steps`` steps."""
        return [(noise_multiplier, self.rate, self.rounds(steps))]


def reduction_for(kind: str, *, sample_rate: float, bands: int = 1) -> Reduction:
    """The :class:`Reduction` of ``kind`` (``sample_rate``: the rate of a sampled example's
    group, ``q_g``; for ``independent`` the loader's ``q``)."""
    if kind == "independent":
        return Reduction(kind, 1, sample_rate)
    if kind == "banded":
        return Reduction(kind, bands, sample_rate)
    return Reduction(kind, 0, 1.0)


def noise_multiplier_for(reduction: Reduction, *, target_epsilon: float, target_delta: float,
                         steps: int, accountant: str, epsilon_tolerance: float = 0.01,
                         **epsilon_kwargs) -> float:
    """σ such that ``steps`` steps of the mechanism spend at most ``target_epsilon``."""
    return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                sample_rate=reduction.rate, steps=reduction.rounds(steps),
                                accountant=accountant, epsilon_tolerance=epsilon_tolerance,
                                **epsilon_kwargs)


@dataclass(frozen=True)
class MechanismHooks:
    """What the engine's wiring installs for a mechanism: the accountant's ``record_step`` hook and
    ``next_rate()``, the rate the budget guard charges the coming step."""

    record_step: Callable
    next_rate: Callable[[], float]


def hooks_for(accountant, reduction: Reduction, dp_optimizer) -> MechanismHooks:
    """The :class:`MechanismHooks` of ``reduction`` for ``dp_optimizer`` (its ``steps_taken``
    is the index of the coming step)."""
    return MechanismHooks(step_hook(accountant, reduction), lambda: reduction.rate_at(dp_optimizer.steps_taken))


def step_hook(accountant, reduction: Reduction):
    """A DPOptimizer step hook recording :meth:`Reduction.event` of each released step (the
    optimizer's ``steps_taken`` counts it already)."""

    def hook_fn(optimizer) -> None:
        accountant.record(reduction.event(optimizer.steps_taken - 1, optimizer.noise_multiplier))

    return hook_fn
