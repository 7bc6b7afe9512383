"""Adaptive clipping: the bound ``C`` follows a private estimate of a quantile of the norms.

Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive
Clipping" (geometric update). At every step, with ``b_i = 1{‖g_i‖ ≤ C}`` and ``m`` the expected
(global) batch size:

    U  = Σ_i (b_i − ½) + N(0, σ_u²)                 (released with the noisy gradient sum)
    f  = clamp(U / m + ½, 0, 1)                      (estimated unclipped fraction)
    C ← clamp(C · exp(−η (f − γ)), C_min, C_max)     (γ: target unclipped quantile)

The centred indicators ``b_i − ½`` change by at most ½ when one example is added or removed,
so ``U`` is a Gaussian mechanism with noise multiplier ``2σ_u``. Released together with the
gradient sum (sensitivity C, noise ``σ_Δ · C``), the pair is one Gaussian mechanism of noise
multiplier ``z`` with ``z⁻² = σ_Δ⁻² + (2σ_u)⁻²`` (the paper's Theorem 1), so for a requested
total ``z`` (the accountant's σ) the gradient gets ``σ_Δ = (z⁻² − (2σ_u)⁻²)^(−1/2)``, which
needs ``z < 2σ_u``. The divisor is the *expected* batch size, never the sampled one (whose
size is private under Poisson sampling). The new bound depends only on released values:
post-processing.
"""

import math
import sys
from typing import Dict, Optional, Sequence

import torch

from opacus_dp.accountants.validation import as_real
from opacus_dp.optim.clipping import (  # SETTINGS: this module's name for them, as before
    ADAPTIVE_SETTINGS as SETTINGS,
    Clipper,
    check_max_grad_norm,
    flat_factors,
    total_norms,
)

PAPER_TARGET_QUANTILE = 0.5  # clip to the median (the paper's recommendation)
PAPER_LEARNING_RATE = 0.2    # geometric updates (the paper's recommendation)
PAPER_COUNT_STD_FRACTION = 1 / 20  # σ_u = expected batch size / 20 (the paper's recommendation)
LOG_LARGEST_BOUND = math.log(sys.float_info.max)
FINITE = sys.float_info.max


def _real(value, name: str, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` as float if it is a real number in the stated range, else a named error."""
    value = as_real(value, name)
    below = value <= low if low_open else value < low
    if math.isnan(value) or below or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def gradient_noise_multiplier(noise_multiplier: float, unclipped_num_std: float) -> float:
    """``σ_Δ = (z⁻² − (2σ_u)⁻²)^(−1/2)`` (module doc); 0 for ``z = 0``; ValueError if ``z ≥ 2σ_u``."""
    if noise_multiplier == 0:
        return 0.0
    if not noise_multiplier < 2 * unclipped_num_std:
        raise ValueError(
            f"noise_multiplier={noise_multiplier} must be smaller than 2 * unclipped_num_std = "
            f"{2 * unclipped_num_std}: adaptive clipping spends part of the noise on the unclipped "
            "count (Andrew et al. 2021, Theorem 1); raise unclipped_num_std (the paper suggests the "
            "expected batch size / 20) or lower noise_multiplier")
    return (noise_multiplier ** -2 - (2 * unclipped_num_std) ** -2) ** -0.5


def refusal(name: str) -> ValueError:
    """The error for setting ``optimizer.<name>`` (a bound) under adaptive clipping."""
    return ValueError(
        f"optimizer.{name} cannot be set with clipping='adaptive': the bound follows the "
        "private estimate of the unclipped fraction at every step (a clipping-bound schedule "
        "would fight it). Tune target_unclipped_quantile / clipbound_learning_rate, or use "
        "clipping='flat' with a schedule")


class AdaptiveClipper(Clipper):
    """Flat clipping to a bound that adapts towards the ``target_unclipped_quantile`` (module doc).

    Args:
        max_grad_norm: the initial bound ``C``.
        target_unclipped_quantile: γ ∈ [0, 1], the fraction of examples meant to stay unclipped.
        clipbound_learning_rate: η ≥ 0 (the bound changes by at most a factor ``e^η`` per step).
        max_clipbound, min_clipbound: the bound stays in ``[min_clipbound, max_clipbound]``.
        unclipped_num_std: σ_u ≥ 0, std of the noise on the count of unclipped examples.
    """

    def __init__(self, max_grad_norm: float, *, target_unclipped_quantile: float,
                 clipbound_learning_rate: float, max_clipbound: float, min_clipbound: float,
                 unclipped_num_std: float):
        self.target_unclipped_quantile = _real(target_unclipped_quantile, "target_unclipped_quantile",
                                               low=0.0, high=1.0)
        self.clipbound_learning_rate = _real(clipbound_learning_rate, "clipbound_learning_rate", low=0.0,
                                             high=FINITE)
        self.min_clipbound = _real(min_clipbound, "min_clipbound", low=0.0, high=FINITE)
        self.max_clipbound = _real(max_clipbound, "max_clipbound", low=self.min_clipbound, low_open=True)
        self.unclipped_num_std = _real(unclipped_num_std, "unclipped_num_std", low=0.0, high=FINITE)
        self.max_grad_norm = self._checked_bound(max_grad_norm, "max_grad_norm (the initial bound)")
        self.last_unclipped_fraction: Optional[float] = None
        self._pending_count: Optional[torch.Tensor] = None  # of the logical batch being accumulated

    def _checked_bound(self, value, name: str) -> float:
        bound = check_max_grad_norm(value, name)
        if not self.min_clipbound <= bound <= min(self.max_clipbound, FINITE):
            raise ValueError(
                f"{name}={bound} must be finite and lie in [min_clipbound, max_clipbound] = "
                f"[{self.min_clipbound}, {self.max_clipbound}]")
        return bound

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        return gradient_noise_multiplier(noise_multiplier, self.unclipped_num_std)

    def clip_factors(self, per_param_norms):
        return flat_factors(per_param_norms, self.max_grad_norm)

    def observe(self, per_param_norms: Sequence[torch.Tensor]) -> None:
        """Add ``Σ_i (1{‖g_i‖ ≤ C} − ½)`` of this backward pass to the logical batch's count."""
        if not per_param_norms:
            return
        unclipped = (total_norms(per_param_norms) <= self.max_grad_norm).to(torch.float64)
        count = (unclipped - 0.5).sum()
        self._pending_count = count if self._pending_count is None else self._pending_count + count

    def take_observation(self) -> torch.Tensor:
        """The logical batch's centred count (float64 scalar; 0 for an empty batch), now reset."""
        count = self._pending_count if self._pending_count is not None else torch.zeros((), dtype=torch.float64)
        self._pending_count = None
        return count

    def forget_observations(self) -> None:
        self._pending_count = None

    def update(self, noisy_centred_count: float, expected_batch_size: float) -> float:
        """Move the bound after a step from the released count ``U`` (module doc); returns it.
        The product is formed in log space, so no learning rate overflows: the bound stays a
        positive finite float."""
        fraction = min(1.0, max(0.0, noisy_centred_count / expected_batch_size + 0.5))
        log_bound = math.log(self.max_grad_norm) - self.clipbound_learning_rate * (
            fraction - self.target_unclipped_quantile)
        bound = math.exp(min(log_bound, LOG_LARGEST_BOUND))
        bound = min(self.max_clipbound, FINITE, max(self.min_clipbound, bound))
        self.max_grad_norm = max(bound, sys.float_info.min)
        self.last_unclipped_fraction = fraction
        return self.max_grad_norm

    def settings(self) -> Dict[str, float]:
        """The adaptation settings (every process of a distributed run must share them)."""
        return {name: getattr(self, name) for name in SETTINGS}

    def shared_settings(self) -> Dict[str, Optional[float]]:
        return {**super().shared_settings(),
                **{f"adaptive clipping {name}": value for name, value in self.settings().items()}}

    @property
    def releases_statistic(self) -> bool:
        """True: the noisy unclipped count is released with the gradient sum."""
        return True

    def with_bound(self, value) -> Clipper:
        raise refusal("max_grad_norm")

    def with_bounds(self, values: Sequence[float]) -> Clipper:
        raise refusal("max_grad_norms")

    def state_dict(self) -> Dict[str, float]:
        return {"max_grad_norm": self.max_grad_norm, "last_unclipped_fraction": self.last_unclipped_fraction}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.max_grad_norm = self._checked_bound(state["max_grad_norm"], "the saved adaptive bound")
        self.last_unclipped_fraction = state.get("last_unclipped_fraction")

    def __repr__(self):
        return (f"AdaptiveClipper(max_grad_norm={self.max_grad_norm}, target_unclipped_quantile="
                f"{self.target_unclipped_quantile}, clipbound_learning_rate={self.clipbound_learning_rate}, "
                f"min_clipbound={self.min_clipbound}, max_clipbound={self.max_clipbound}, "
                f"unclipped_num_std={self.unclipped_num_std})")


def adaptive_clipper(max_grad_norm: float, *, expected_batch_size: float,
                     target_unclipped_quantile: Optional[float] = None,
                     clipbound_learning_rate: Optional[float] = None, max_clipbound: Optional[float] = None,
                     min_clipbound: Optional[float] = None,
                     unclipped_num_std: Optional[float] = None) -> AdaptiveClipper:
    """An :class:`AdaptiveClipper` whose unset options take the paper's recommendations (γ = ½,
    η = 0.2, σ_u = ``expected_batch_size`` / 20, the global expected batch) and no bound limits."""
    return AdaptiveClipper(
        max_grad_norm,
        target_unclipped_quantile=_or(target_unclipped_quantile, PAPER_TARGET_QUANTILE),
        clipbound_learning_rate=_or(clipbound_learning_rate, PAPER_LEARNING_RATE),
        max_clipbound=_or(max_clipbound, math.inf), min_clipbound=_or(min_clipbound, 0.0),
        unclipped_num_std=_or(unclipped_num_std, PAPER_COUNT_STD_FRACTION * expected_batch_size))


def _or(value, default):
    return default if value is None else value
