"""The settings and state views of :class:`~opacus_dp.optim.DPOptimizer`: σ, the clipping
bounds (flat, per layer or adaptive), the noise source, the step hooks and the trainable
tensors. Each setter checks its value (a scheduler may change it between steps), so a step
never runs with a σ or bound that could not be noised.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from opacus_dp.optim.adaptive_clipping import SETTINGS as ADAPTIVE_SETTINGS, AdaptiveClipper
from opacus_dp.optim.clipping import Clipper, FlatClipper, PerLayerClipper
from opacus_dp.optim.noise import check_noise_multiplier, noise_std


class DPOptimizerSettingsMixin:
    """Settings, hooks and state views of ``DPOptimizer`` (module doc)."""

    def attach_step_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        """Call ``fn(optimizer)`` after every (non-skipped) step; returns a removable handle."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = fn
        return handle

    def attach_pre_step_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        """Call ``fn(optimizer)`` before a (non-skipped) step changes anything; may raise."""
        handle = RemovableHandle(self._pre_step_hooks)
        self._pre_step_hooks[handle.id] = fn
        return handle

    @property
    def params(self) -> List[torch.Tensor]:
        """Trainable tensors of the wrapped optimizer, in ``param_groups`` order."""
        return [p for g in self.original_optimizer.param_groups for p in g["params"] if p.requires_grad]

    @property
    def noise_multiplier(self) -> float:
        """σ, read at every step (noise std σ · the clipper's sensitivity; the accountant
        records the σ of each step). Checked when set, as a scheduler may change it."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value) -> None:
        value = check_noise_multiplier(value)
        if hasattr(self, "clipper"):
            noise_std(value, self.clipper)
        self._noise_multiplier = value

    def _set_clipper(self, clipper: Clipper) -> None:
        clipper.check_num_params(len(self.params))
        noise_std(self.noise_multiplier, clipper)  # an infinite bound cannot be noised
        self.clipper = clipper

    @property
    def max_grad_norm(self) -> float:
        """C for flat clipping; ‖(C_l)‖₂ for per-layer clipping."""
        return self.clipper.sensitivity

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._refuse_with_adaptive_clipping("max_grad_norm")
        if not isinstance(self.clipper, FlatClipper):
            raise ValueError("max_grad_norm can only be changed for flat clipping; set max_grad_norms")
        self._set_clipper(FlatClipper(value))

    @property
    def max_grad_norms(self) -> List[float]:
        """Per-layer bounds (per-layer clipping) or ``[C]`` (flat)."""
        if isinstance(self.clipper, PerLayerClipper):
            return list(self.clipper.max_grad_norms)
        return [self.clipper.sensitivity]

    @max_grad_norms.setter
    def max_grad_norms(self, values: Sequence[float]) -> None:
        self._refuse_with_adaptive_clipping("max_grad_norms")
        self._set_clipper(PerLayerClipper(values))
        self._bound_index = {p: i for i, p in enumerate(self.params)}
        self._share_factor_function()  # per-layer now: sums may be formed during backward

    def _refuse_with_adaptive_clipping(self, name: str) -> None:
        if isinstance(self.clipper, AdaptiveClipper):
            raise ValueError(
                f"optimizer.{name} cannot be set with clipping='adaptive': the bound follows the "
                "private estimate of the unclipped fraction at every step (a clipping-bound schedule "
                "would fight it). Tune target_unclipped_quantile / clipbound_learning_rate, or use "
                "clipping='flat' with a schedule")

    # ------------------------------------------- what every process of a distributed run shares
    def _step_settings(self) -> Dict[str, float]:
        """The settings every process must share at each step (a scheduler may change σ or the
        bounds between steps): checked in the step's own all-reduce (a distributed reducer)."""
        return {"noise_multiplier": self.noise_multiplier,
                "max_grad_norm (sensitivity)": self.clipper.sensitivity,
                "sum of clipping bounds": float(sum(self.max_grad_norms)),
                "batches merged into the step": float(self.accumulated_iterations)}

    def settings_ranks_share(self) -> Dict[str, Optional[float]]:
        """Every setting all processes must share: the :meth:`_step_settings` and those fixed
        for the run (checked once, collectively, when the distributed reduction is set up)."""
        adaptive = self.clipper.settings() if isinstance(self.clipper, AdaptiveClipper) else {}
        return {**self._step_settings(),
                "expected_batch_size": self.expected_batch_size,
                "loss_reduction(mean=1)": float(self.loss_reduction == "mean"),
                "poisson_sampling(yes=1)": float(self.poisson_batches),
                **{f"adaptive clipping {name}": adaptive.get(name) for name in ADAPTIVE_SETTINGS}}

    def clipping_state_dict(self) -> dict:
        """What the clipper learned (the current adaptive bound; empty for fixed bounds)."""
        return self.clipper.state_dict()

    def load_clipping_state_dict(self, state: dict) -> None:
        self.clipper.load_state_dict(state)

    @property
    def secure_mode(self) -> bool:
        return self.noise.secure_mode

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.noise.generator

    def noise_state_dict(self) -> dict:
        """State of the noise generator, for reproducible resumption."""
        params = self.params
        if params and not self.noise.secure_mode:
            self.noise.generator_for(params[0].device)  # materialise it where the noise is drawn
        return self.noise.state_dict()

    def load_noise_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state)
