"""Correlated noise across steps: ``z_t = (C⁻¹ w)_t`` generated as the steps go.

``w_t`` are the i.i.d. Gaussian draws of :class:`~opacus_dp.optim.noise.GaussianNoise` (its
generator, secure mode included) with std ``σ · C_clip · Δ`` (``Δ``: the strategy's
sensitivity), one per step and trainable tensor; step ``t`` adds ``z_t`` to the summed clipped
gradient instead of ``w_t``. Since ``C z = w`` with ``c₀ = 1``:

* ``banded`` (``c_k = 0`` for ``k ≥ b``): ``z_t = w_t − Σ_{k=1}^{b−1} c_k z_{t−k}``, keeping
  the last ``b − 1`` noise tensors;
* ``blt`` (``c_k = Σ_i ω_i θ_iᵏ⁻¹``): ``z_t = w_t − Σ_i ω_i s_{i,t}`` with
  ``s_{i,t+1} = θ_i s_{i,t} + z_t`` (Dvijotham et al. 2024): ``d`` buffers of model size;
* ``tree``: ``z_t = w_t − Σ_{l<j} (open nodes of levels below j)``, ``j`` the trailing zeros
  of ``t + 1`` (:mod:`~opacus_dp.mechanisms.tree`): at most ``⌊log₂ n⌋ + 1`` buffers;
* ``C = I`` (``b = 1``): ``z_t = w_t``, the draws of DP-SGD bit for bit.

The buffers are committed at the start of the next step (:meth:`begin_step`), so a step refused
after its noise was drawn (:meth:`discard_step`) leaves them as they were. They are part of
:meth:`state_dict` (checkpoints), with the steps taken and the strategy's schedule (kind, steps,
bands, period): a state saved for another schedule is refused. With a
:class:`~opacus_dp.data.cyclic_sampler.StepSchedule` (the engine's), a step whose index is not
the schedule's (the optimizer's released steps, which the sampling and the accountant use) is
refused before anything is drawn. With several processes only the rank that adds the noise
(:mod:`~opacus_dp.distributed.reducers`) uses them.
"""

from typing import Dict, List, Optional

import torch

from opacus_dp.data.cyclic_sampler import StepSchedule
from opacus_dp.mechanisms import tree
from opacus_dp.mechanisms.strategies import Strategy
from opacus_dp.optim.noise import GaussianNoise


class CorrelatedNoise:
    """Noise of ``strategy`` for the tensors of each step (module doc); draws from ``base``.

    Within a step, :meth:`sample` is called once per tensor, in the same order every step.
    """

    def __init__(self, strategy: Strategy, base: Optional[GaussianNoise] = None,
                 schedule: Optional[StepSchedule] = None):
        self.strategy = strategy
        self.base = base if base is not None else GaussianNoise()
        self.schedule = schedule
        self.step_index = -1  # index of the current (or last) step
        # banded: the z's of the last b − 1 steps; blt: [θ-buffers per tensor]; tree: [open nodes per tensor]
        self._history: List[List[torch.Tensor]] = []
        self._pending: Dict[int, torch.Tensor] = {}  # this step's z per slot, committed by the next
        self._slot, self._open = 0, False
        if strategy.kind == "blt":
            self._theta, self._omega = (torch.tensor(v, dtype=torch.float64) for v in strategy.blt)

    # the generator of the draws, as GaussianNoise (checkpoints, distributed refusal)
    secure_mode = property(lambda self: self.base.secure_mode)

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.base.generator

    @generator.setter
    def generator(self, value: Optional[torch.Generator]) -> None:
        self.base.generator = value

    def generator_for(self, device: torch.device) -> torch.Generator:
        return self.base.generator_for(device)

    def begin_step(self, device: torch.device) -> None:
        """Commit the previous step's noise, then start a step."""
        self._commit()
        self.check_schedule()
        if self.strategy.kind in ("blt", "tree") and self.step_index + 1 >= self.strategy.steps:
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

    def discard_step(self) -> None:
        """Forget the noise drawn in the current step (it was not released)."""
        if self._open:
            self._pending, self._slot, self._open = {}, 0, False
            self.step_index -= 1

    def sample(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """``z_t`` for the next tensor of this step (``std``: ``σ·C_clip``)."""
        slot, self._slot = self._slot, self._slot + 1
        w = self.base.sample(reference, std * self.strategy.sensitivity if std else 0.0)
        if self.strategy.kind == "independent" or self.strategy.bands == 1:
            return w
        if self.strategy.kind == "tree":
            self._pending[slot] = w
            return self._tree(w, slot)
        z = self._banded(w, slot) if self.strategy.kind == "banded" else self._blt(w, slot)
        self._pending[slot] = z
        return z.clone()

    def _banded(self, w: torch.Tensor, slot: int) -> torch.Tensor:
        z = w.clone()
        for k, past in enumerate(reversed(self._history), start=1):
            z.sub_(past[slot], alpha=self.strategy.coefficients[k])
        return z

    def _blt(self, w: torch.Tensor, slot: int) -> torch.Tensor:
        z = w.clone()
        if self._history:
            buffers = self._history[0][slot]
            z.sub_(torch.tensordot(self._omega.to(buffers), buffers, dims=1))
        return z

    def _tree(self, w: torch.Tensor, slot: int) -> torch.Tensor:
        """``w − Σ`` the nodes that close (the lowest ``j`` open ones, stored by level)."""
        z = w.clone()
        for node in self._history[slot][:tree.trailing_zeros(self.step_index + 1)] if self._history else ():
            z.sub_(node)
        return z

    def _commit(self) -> None:
        self._open = False
        if not self._pending:
            return
        pending = [self._pending[i] for i in range(len(self._pending))]
        if self.strategy.kind == "tree":
            closing = tree.trailing_zeros(self.step_index + 1)
            self._history = [[w] + (self._history[i][closing:] if self._history else []) for i, w in enumerate(pending)]
        elif self.strategy.kind == "banded":
            self._history.append(pending)
            del self._history[:max(0, len(self._history) - (self.strategy.bands - 1))]
        else:
            self._history = [[self._updated_buffers(i, z) for i, z in enumerate(pending)]]
        self._pending = {}

    def _updated_buffers(self, slot: int, z: torch.Tensor) -> torch.Tensor:
        """``s_i ← θ_i s_i + z`` for all ``i`` (stacked: ``d × shape``)."""
        theta = self._theta.to(z).reshape(-1, *([1] * z.dim()))
        if not self._history:
            return z.unsqueeze(0).expand(len(self._theta), *z.shape).clone()
        return self._history[0][slot].mul_(theta).add_(z)

    def _schedule_record(self) -> dict:
        strategy = self.strategy
        return {"kind": strategy.kind, "steps": int(strategy.steps), "bands": int(strategy.bands),
                "period": int(strategy.period)}

    def state_dict(self) -> dict:
        """The generator's state (as :class:`GaussianNoise`), the steps taken, the strategy's
        schedule and the buffers."""
        self._commit()
        return {**self.base.state_dict(), "mechanism": self.strategy.kind,
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
        self.base.load_state_dict(state)
        self._history = [[t.clone() for t in step] for step in state.get("buffers", [])]
        self.step_index = int(state.get("mechanism_steps", 0)) - 1
        self._pending, self._slot, self._open = {}, 0, False
