"""How ``PrivacyEngine.make_private(..., noise_mechanism=, bands=, epochs=)`` sets a mechanism up.

:func:`plan_mechanism` checks the request and computes the strategy for the run's steps;
the plan then builds the loader whose sampling the analysis covers (:meth:`MechanismPlan.loader`,
a cyclic Poisson loader, :mod:`~opacus_dp.data.cyclic_sampler`), :func:`correlated_noise` the
noise the optimizer is built with, and :func:`connect_mechanism` returns the accountant's step hook
(:mod:`~opacus_dp.mechanisms.accounting`). ``independent`` needs no plan (the engine is unchanged).

* ``banded`` (``bands = b``): ``b`` groups, group rate ``q_g = b·q`` (the expected batch stays
  ``q·N``; needs ``b ≤ 1/q``, the steps of a pass), ``⌈S/b⌉·b`` steps per pass.
* ``tree`` and ``blt``: ``S = len(data_loader)`` groups taken in turn with rate 1 (every example once per
  pass, in a fixed slot; no amplification is claimed), ``epochs · S`` steps at most.

The loader, the noise and the accountant read the index of a step from one
:class:`~opacus_dp.data.cyclic_sampler.StepSchedule` that follows the optimizer's released steps
(``steps_taken``, saved in checkpoints): step ``t`` samples group ``t mod groups`` and is charged
as step ``t`` of its round, whatever passes, breaks and resumptions led to it.
"""

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from opacus_dp.data.cyclic_sampler import CyclicPoissonSampler, StepSchedule
from opacus_dp.data.data_loader import DPDataLoader, worker_settings
from opacus_dp.data.loader_facts import expected_batch_size_for, sample_rate_of
from opacus_dp.data.samplers import distributed_world
from opacus_dp.data.sampling_checks import check_batching, check_replaceable_sampler
from opacus_dp.mechanisms.accounting import MechanismHooks, Reduction, hooks_for, noise_multiplier_for, reduction_for
from opacus_dp.mechanisms.noise import CorrelatedNoise
from opacus_dp.optim.noise import GaussianNoise
from opacus_dp.mechanisms.strategies import KINDS, Strategy, make_strategy


class CyclicPoissonDataLoader(DPDataLoader):
    """A :class:`~opacus_dp.data.DPDataLoader` drawing cyclic Poisson batches over ``groups``
    groups at rate ``sample_rate`` (:class:`~opacus_dp.data.cyclic_sampler.CyclicPoissonSampler`)
    for the steps of ``schedule``. With worker processes the batches are drawn ahead, and each is
    checked against the schedule when it is handed out."""

    def __init__(self, dataset, *, groups: int, schedule: Optional[StepSchedule] = None, **kwargs):
        self.groups = groups
        self.schedule = schedule if schedule is not None else StepSchedule()
        super().__init__(dataset, **kwargs)
        self.batch_sampler.draws_ahead = self.num_workers > 0

    def _make_batch_sampler(self, num_samples: int, generator, steps):
        world, rank = distributed_world(None, None) if self.distributed else (1, 0)
        return CyclicPoissonSampler(num_samples, groups=self.groups, group_rate=self.sample_rate,
                                    generator=generator, steps=steps, rank=rank, num_replicas=world,
                                    schedule=self.schedule)

    def __iter__(self):
        sampler = self.batch_sampler
        if not sampler.draws_ahead:
            return super().__iter__()  # each batch is drawn when it is asked for, and checked then
        labels = sampler.label_sink = deque()  # the steps this pass draws (workers: at its start)
        return self._checked(super().__iter__(), labels)

    def _checked(self, batches, labels: deque):
        for batch in batches:
            self.batch_sampler.check_hand_out(labels.popleft())
            yield batch


@dataclass(frozen=True)
class MechanismPlan:
    """A checked request: ``strategy``, accounting ``reduction``, loader ``groups`` and rate,
    ``steps`` per pass and planned ``total_steps``; ``schedule``, the step index that loader,
    noise and accountant share (connected to the optimizer by :func:`connect_mechanism`)."""

    strategy: Strategy
    reduction: Reduction
    groups: int
    group_rate: float
    steps_per_pass: int
    total_steps: int
    num_samples: int
    schedule: StepSchedule = field(default_factory=StepSchedule, compare=False)

    def expected_batch_size(self, sample_rate: Optional[float] = None) -> int:
        """``⌊q_g·N/b⌋`` (``sample_rate`` instead of ``q_g/b``: ``⌊sample_rate·N⌋``)."""
        rate = self.group_rate / self.groups if sample_rate is None else sample_rate
        return expected_batch_size_for(self.num_samples, rate)

    def loader(self, data_loader, *, generator=None, distributed: bool = False,
               batch_first: bool = True) -> CyclicPoissonDataLoader:
        """The cyclic Poisson loader over ``data_loader``'s dataset (its collate, workers and,
        unless given, generator)."""
        return CyclicPoissonDataLoader(
            data_loader.dataset, groups=self.groups, sample_rate=self.group_rate,
            collate_fn=data_loader.collate_fn, distributed=distributed, batch_first=batch_first,
            generator=generator if generator is not None else data_loader.generator,
            steps=self.steps_per_pass, schedule=self.schedule, **worker_settings(data_loader))


def _refuse(noise_mechanism: str, reason: str) -> ValueError:
    return ValueError(f"noise_mechanism={noise_mechanism!r}: {reason}; nothing was changed")


def plan_mechanism(noise_mechanism: str, *, data_loader, bands: Optional[int], epochs,
                   poisson_sampling: bool, clipping: str = "flat", buffers: int = 4,
                   momentum: float = 0.0) -> Optional[MechanismPlan]:
    """The plan of a correlated mechanism (module doc), None for ``independent``; ValueError for
    a request the analysis does not cover."""
    if noise_mechanism not in KINDS:
        raise ValueError(f"noise_mechanism must be one of {KINDS}, got {noise_mechanism!r}")
    if noise_mechanism == "independent":
        if bands not in (None, 1):
            raise _refuse(noise_mechanism, "bands only apply to noise_mechanism='banded'")
        return None
    if not poisson_sampling:
        raise _refuse(noise_mechanism, "its privacy analysis needs the engine's cyclic Poisson "
                      "loader; pass poisson_sampling=True (the engine then samples itself)")
    where = f"make_private(noise_mechanism={noise_mechanism!r})"
    if isinstance(data_loader, CyclicPoissonDataLoader):
        raise _refuse(noise_mechanism, "data_loader is already a cyclic Poisson loader: pass the user's "
                      "original loader, the engine builds the sampling itself")
    check_batching(data_loader, where)
    check_replaceable_sampler(data_loader, where)  # a subset or weights would be dropped
    if clipping == "adaptive":
        raise _refuse(noise_mechanism, "adaptive clipping releases a count with independent noise "
                      "that this analysis does not cover; use clipping='flat' or 'per_layer'")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < math.inf:
        raise _refuse(noise_mechanism, f"the strategy is optimised for the run's length: pass "
                      f"epochs (a positive number), got {epochs!r}")
    steps = len(data_loader)
    if noise_mechanism == "banded":
        return _banded_plan(data_loader, bands, epochs, steps, momentum)
    if bands is not None:
        raise _refuse(noise_mechanism, "bands only apply to noise_mechanism='banded'")
    total = math.ceil(epochs * steps)
    strategy = make_strategy(noise_mechanism, steps=total, buffers=buffers, period=steps, momentum=momentum)
    return MechanismPlan(strategy, reduction_for(noise_mechanism, sample_rate=1.0), steps, 1.0, steps, total,
                         len(data_loader.dataset))


def _banded_plan(data_loader, bands, epochs, steps: int, momentum: float) -> MechanismPlan:
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise _refuse("banded", f"bands must be a positive int, got {bands!r}")
    rate = sample_rate_of(data_loader) * bands
    if rate > 1 + 1e-12 or bands > len(data_loader.dataset):
        raise _refuse("banded", f"bands={bands} exceeds the {steps} steps of a pass (1/sample_rate): "
                      "each group's sampling rate b·q would exceed 1; use fewer bands")
    per_pass = math.ceil(steps / bands) * bands
    total = math.ceil(epochs * per_pass)
    strategy = make_strategy("banded", steps=total, bands=bands, momentum=momentum)
    return MechanismPlan(strategy, reduction_for("banded", sample_rate=min(rate, 1.0), bands=bands),
                         bands, min(rate, 1.0), per_pass, total, len(data_loader.dataset))


def correlated_noise(plan: Optional[MechanismPlan], base: GaussianNoise):
    """The noise of the run: ``base`` (independent) without a plan, else the plan's correlated
    noise drawn from ``base`` and indexed by the plan's schedule (given to the optimizer)."""
    return base if plan is None else CorrelatedNoise(plan.strategy, base=base, schedule=plan.schedule)


def connect_mechanism(plan: Optional[MechanismPlan], dp_optimizer, accountant) -> Optional[MechanismHooks]:
    """Connect the plan's schedule to ``dp_optimizer``'s released steps (``steps_taken``, the
    counter the accountant's hooks read), refuse a step whose noise index is not the schedule's,
    and return the accountant's and the budget guard's hooks; None (nothing changed) without a
    plan."""
    if plan is None:
        return None
    plan.schedule.follow(lambda: dp_optimizer.steps_taken)
    dp_optimizer.attach_pre_step_hook(_schedule_check)
    dp_optimizer.noise.analyse_with(_noise_settings(dp_optimizer))
    dp_optimizer.attach_pre_step_hook(_fixed_noise_check)
    return hooks_for(accountant, plan.reduction, dp_optimizer)


def _schedule_check(optimizer) -> None:
    """A pre-step hook refusing a step whose noise index is not the schedule's, where this
    process draws the noise (so that with several processes every rank refuses that step)."""
    if optimizer.reducer.draws_noise:
        optimizer.noise.check_schedule()


def _noise_settings(optimizer) -> tuple:
    return float(optimizer.noise_multiplier), tuple(float(c) for c in optimizer.max_grad_norms)


def _fixed_noise_check(optimizer) -> None:
    """A pre-step hook refusing a step whose σ or clipping bounds differ from those the run was
    made private with (``noise.analysed``, kept in checkpoints): the correlated analysis (one event
    per round, or per run) assumes the same noise std σ·C and sensitivity C at every step."""
    planned, now = optimizer.noise.analysed, _noise_settings(optimizer)
    if now != planned:
        raise ValueError(
            f"noise_mechanism={optimizer.noise.strategy.kind!r} is analysed for fixed noise_multiplier and "
            f"max_grad_norm (σ={planned[0]}, bounds {list(planned[1])}), this step has σ={now[0]}, bounds "
            f"{list(now[1])}: a noise or clipping-bound scheduler cannot be used with correlated noise "
            "(use noise_mechanism='independent'); nothing was released")


def calibrated_noise_multiplier(plan: MechanismPlan, *, accountant: str, target_epsilon: float,
                                target_delta: float, epsilon_tolerance: float = 0.01, **epsilon_kwargs) -> float:
    """σ of the planned correlated mechanism for its planned steps within ``target_epsilon``."""
    return noise_multiplier_for(plan.reduction, target_epsilon=target_epsilon, target_delta=target_delta,
                                steps=plan.total_steps, accountant=accountant,
                                epsilon_tolerance=epsilon_tolerance, **epsilon_kwargs)
