"""Correlated-noise (matrix-factorisation) mechanisms: strategies, noise, accounting.

``PrivacyEngine.make_private(..., noise_mechanism="banded", bands=b, epochs=E)`` (or "blt",
"tree") wires everything (:mod:`~opacus_dp.mechanisms.engine`; guide: ``docs/mechanisms.md``).
A :class:`~opacus_dp.optim.DPOptimizer` built by hand takes the noise in its constructor,
``DPOptimizer(..., noise=CorrelatedNoise(make_strategy(...), base=GaussianNoise(), schedule=schedule))``,
and its accountant the hook :func:`~opacus_dp.mechanisms.accounting.step_hook`; with
``schedule = StepSchedule()`` passed to the :class:`~opacus_dp.data.cyclic_sampler.CyclicPoissonSampler`
too and ``schedule.follow(lambda: optimizer.steps_taken)`` once the optimizer exists, sampling,
noise and accounting share one step index (as ``make_private`` wires them).
"""

from opacus_dp.mechanisms.noise import CorrelatedNoise
from opacus_dp.mechanisms.strategies import KINDS, Strategy, make_strategy

__all__ = ["CorrelatedNoise", "KINDS", "Strategy", "make_strategy"]
