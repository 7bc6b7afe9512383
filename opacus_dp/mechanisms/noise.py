"""Correlated noise across steps: ``z_t = (C⁻¹ w)_t`` generated as the steps go.

``w_t`` are the i.i.d. Gaussian draws of :class:`~opacus_dp.optim.noise.GaussianNoise` (its
generator, secure mode included) with std ``σ · C_clip · Δ`` (``Δ``: the strategy's
sensitivity), one per step and trainable tensor; step ``t`` adds ``z_t`` to the summed clipped
gradient instead of ``w_t``. Since ``C z = w`` with ``c₀ = 1``, ``z_t`` is ``w_t`` corrected
by what the earlier steps left, by the :class:`~opacus_dp.mechanisms.recursion.Recursion` of
the strategy's kind (:data:`RECURSIONS`): banded (:mod:`~opacus_dp.mechanisms.banded_noise`,
``b − 1`` noise tensors kept), BLT (:mod:`~opacus_dp.mechanisms.blt_noise`, ``d`` buffers of
model size), tree (:mod:`~opacus_dp.mechanisms.tree_noise`, at most ``⌊log₂ n⌋ + 1``
buffers); ``C = I`` (one band) gives ``z_t = w_t``, the draws of DP-SGD bit for bit.

The buffers are committed at the start of the next step (:meth:`begin_step`), so a step refused
after its noise was drawn (:meth:`discard_step`) leaves them as they were. They are part of
:meth:`state_dict` (checkpoints), with the steps taken, the strategy's schedule (kind, steps,
bands, period) and ``analysed`` (σ and clipping bounds): a state saved for others is refused. With a
:class:`~opacus_dp.data.cyclic_sampler.StepSchedule` (the engine's), a step whose index is not
the schedule's (the optimizer's released steps, which the sampling and the accountant use) is
refused before anything is drawn. With several processes only the rank that adds the noise
(:mod:`~opacus_dp.distributed.reducers`) uses them.
"""

from typing import Dict, Optional

import torch

from opacus_dp.data.cyclic_sampler import StepSchedule
from opacus_dp.mechanisms.banded_noise import BandedRecursion
from opacus_dp.mechanisms.blt_noise import BltRecursion
from opacus_dp.mechanisms.recursion import History, IndependentRecursion, Recursion
from opacus_dp.mechanisms.strategies import Strategy
from opacus_dp.mechanisms.tree_noise import TreeRecursion
from opacus_dp.optim.noise import GaussianNoise, sampled_plus

RECURSIONS = {"independent": IndependentRecursion, "banded": BandedRecursion, "blt": BltRecursion,
              "tree": TreeRecursion}


def recursion_for(strategy: Strategy) -> Recursion:
    """The recursion of ``strategy``'s kind; with one band (``C = I``) the draws pass through."""
    recursion = RECURSIONS[strategy.kind]
    if strategy.bands == 1:
        return IndependentRecursion(limited_to_planned_steps=recursion.limited_to_planned_steps)
    return recursion(strategy)


class CorrelatedNoise:
    """Noise of ``strategy`` for the tensors of each step (module doc); draws from ``base``.

    A :class:`~opacus_dp.optim.noise_mechanism.NoiseMechanism`. Within a step, :meth:`sample` is
    called once per tensor, in the same order every step.
    """

    shards_alike = False  # a rank's noise depends on its earlier steps' noise of the same tensors

    def __init__(self, strategy: Strategy, base: Optional[GaussianNoise] = None,
                 schedule: Optional[StepSchedule] = None):
        self.strategy = strategy
        self.base = base if base is not None else GaussianNoise()
        self.schedule = schedule
        self.step_index = -1  # index of the current (or last) step
        self._recursion = recursion_for(strategy)
        self._history: History = []  # the recursion's state, committed
        self._pending: Dict[int, torch.Tensor] = {}  # what this step keeps per slot, committed by the next
        self._slot, self._open = 0, False
        self.analysed: Optional[tuple] = None  # (σ, clipping bounds) of every step, set by the engine

    # the generator of the draws, as GaussianNoise (checkpoints, step refusal, streams)
    secure_mode = property(lambda self: self.base.secure_mode)

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.base.generator

    @generator.setter
    def generator(self, value: Optional[torch.Generator]) -> None:
        self.base.generator = value

    def generator_for(self, device: torch.device) -> torch.Generator:
        return self.base.generator_for(device)

    def stream_base(self) -> bytes:
        return self.base.stream_base()

    def reseed(self, seed: int) -> None:
        self.base.reseed(seed)

    def begin_step(self, device: torch.device) -> None:
        """Commit the previous step's noise, then start a step."""
        self._commit()
        self.check_schedule()
        if self._recursion.limited_to_planned_steps and self.step_index + 1 >= self.strategy.steps:
            raise RuntimeError(
                f"the {self.strategy.kind} noise was planned and accounted for {self.strategy.steps} steps: this "
                "would be one more; plan the run with more epochs (make_private(..., epochs=))")
        self.step_index += 1
        self._slot, self._open = 0, True
        self.base.begin_step(device)

    def check_schedule(self) -> None:
        """Refuse a step whose index is not the schedule's (e.g. noise state and step count
        restored from different points)."""
        if self.schedule is None or not self.schedule.connected:
            return
        expected = self.schedule.next_step()
        if self.step_index + 1 != expected:
            raise RuntimeError(
                f"the {self.strategy.kind} noise has taken {self.step_index + 1} steps but the optimizer has "
                f"released {expected}: the noise correlation and the sampling schedule would disagree. "
                "Restore the noise state and the step count from the same checkpoint "
                "(PrivacyEngine.load_checkpoint); nothing was released")

    def snapshot(self):
        """The draws' generator state before a step (:meth:`GaussianNoise.snapshot`)."""
        return self.base.snapshot()

    def restore(self, snapshot) -> None:
        """Undo a refused step: its noise is forgotten and the generator is back to ``snapshot``."""
        self.discard_step()
        self.base.restore(snapshot)

    def discard_step(self) -> None:
        """Forget the noise drawn in the current step (it was not released)."""
        if self._open:
            self._pending, self._slot, self._open = {}, 0, False
            self.step_index -= 1

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """``z_t`` for the next tensor of this step (``std``: ``σ·C_clip``)."""
        slot, self._slot = self._slot, self._slot + 1
        w = self.base.sample(reference, std * self.strategy.sensitivity if std else 0.0)
        z, kept = self._recursion.correct(w, slot, self._history, self.step_index)
        if kept is not None:
            self._pending[slot] = kept
        return z

    def noised(self, total: torch.Tensor, std: float, reuse: bool = False) -> torch.Tensor:
        """``total + z_t`` (:meth:`sample`'s noise; :func:`~opacus_dp.optim.noise.sampled_plus`)."""
        return sampled_plus(self.sample(total, std), total, reuse)

    def _commit(self) -> None:
        self._open = False
        if not self._pending:
            return
        pending = [self._pending[i] for i in range(len(self._pending))]
        self._history = self._recursion.commit(self._history, pending, self.step_index)
        self._pending = {}

    def _schedule_record(self) -> dict:
        strategy = self.strategy
        return {"kind": strategy.kind, "steps": int(strategy.steps), "bands": int(strategy.bands),
                "period": int(strategy.period)}

    def state_dict(self) -> dict:
        """The generator's state (as :class:`GaussianNoise`), the steps taken, the strategy's
        schedule and the buffers."""
        self._commit()
        analysed = None if self.analysed is None else [self.analysed[0], list(self.analysed[1])]
        return {**self.base.state_dict(), "mechanism": self.strategy.kind, "mechanism_settings": analysed,
                "mechanism_steps": self.step_index + 1, "mechanism_schedule": self._schedule_record(),
                "buffers": [[t.clone() for t in step] for step in self._history]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the state of another mechanism (or of DP-SGD's
        :class:`GaussianNoise`, without buffers) is refused, except for ``C = I``."""
        saved = state.get("mechanism", "independent")
        if saved != self.strategy.kind and self.strategy.bands != 1:
            raise ValueError(f"the noise state was saved for the {saved!r} mechanism, this optimizer "
                             f"uses {self.strategy.kind!r}: its correlation cannot be resumed from it")
        schedule = state.get("mechanism_schedule")
        if schedule is not None and schedule != self._schedule_record():
            raise ValueError(
                f"the noise state was saved for the schedule {schedule}, this optimizer uses "
                f"{self._schedule_record()}: groups, rounds and correlation would change mid-run. "
                "Resume with the make_private arguments of the saved run (noise_mechanism, bands, "
                "epochs, the data loader's batch size)")
        self._check_settings(state.get("mechanism_settings"))
        self.base.load_state_dict(state)
        self._history = [[t.clone() for t in step] for step in state.get("buffers", [])]
        self.step_index = int(state.get("mechanism_steps", 0)) - 1
        self._pending, self._slot, self._open = {}, 0, False

    def analyse_with(self, settings: tuple) -> None:
        """``(σ, clipping bounds)`` of every step of the run (its analysis; kept in checkpoints)."""
        self.analysed = settings

    def _check_settings(self, saved) -> None:
        """Refuse a state saved by a run noised with another σ or other clipping bounds: the
        analysis of the whole run assumes the same ones at every step."""
        if saved is None or self.analysed is None:
            return
        saved = (float(saved[0]), tuple(float(c) for c in saved[1]))
        if saved != self.analysed:
            raise ValueError(
                f"the noise state was saved by a run with noise_multiplier {saved[0]} and clipping bounds "
                f"{list(saved[1])}, this optimizer has {self.analysed[0]} and {list(self.analysed[1])}: the "
                f"{self.strategy.kind} analysis needs the same at every step. Resume with the saved run's "
                "noise_multiplier and max_grad_norm")
