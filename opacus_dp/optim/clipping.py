"""Clipping strategies: per-sample norms -> per-sample scaling factors, plus sensitivity.

A clipper sees, for every trainable tensor ``l``, the per-sample norms ``n_il = ‖g_il‖₂``
and returns one factor per sample and tensor such that the clipped per-sample gradient
``(f_il · g_il)_l`` has a bounded norm. It also reports its ``sensitivity``: the largest
possible L2 norm of one sample's clipped contribution to the summed gradient. The noise
std is ``σ · sensitivity`` (computed in :mod:`opacus_dp.optim.noise` only).

Both strategies here follow Abadi et al. 2016, "Deep Learning with Differential Privacy":
``f = min(1, C / (‖g‖ + 1e-6))``; the ``1e-6`` guards against division by zero. A bound that
adapts during training is in :mod:`opacus_dp.optim.adaptive_clipping`; the normalising rules
(automatic clipping, PSAC) are in :mod:`opacus_dp.optim.automatic_clipping` and
:mod:`opacus_dp.optim.psac_clipping`; :mod:`opacus_dp.optim.clipper_registry` builds one by name.

The optimizer never tests a clipper's type: it asks the capabilities of :class:`Clipper`
(``per_tensor``, ``factor_of``, ``bounds``, ``with_bound``, ``with_bounds``, ``shared_settings``,
``releases_statistic``), whose defaults here describe a fixed flat bound.
"""

import abc
import math
import numbers
from typing import Dict, List, Optional, Sequence

import torch

from opacus_dp.maths.per_sample import (  # noqa: F401  (also this module's names, as before)
    check_finite_norm_list,
    check_finite_norms,
    per_sample_norms,
    sum_dtype,
    weighted_sum,
)

CLIP_EPSILON = 1e-6
ADAPTIVE_SETTINGS = ("target_unclipped_quantile", "clipbound_learning_rate", "min_clipbound", "max_clipbound",
                     "unclipped_num_std")
AUTOMATIC_GAMMA_SETTING = "automatic clipping gamma"
PSAC_R_SETTING = "psac clipping r"
# the settings beyond σ and C that all ranks share: the same names for every clipper (None where a
# clipper has no such setting), so every rank's agreement table has the same shape
SHARED_SETTING_NAMES = tuple(f"adaptive clipping {name}" for name in ADAPTIVE_SETTINGS) + (
    AUTOMATIC_GAMMA_SETTING, PSAC_R_SETTING)
FLAT_ONLY = "max_grad_norm can only be changed for flat clipping; set max_grad_norms"


def check_max_grad_norm(value, name: str = "max_grad_norm") -> float:
    """``value`` as float if it is a valid clipping bound (> 0, not NaN), else ValueError.

    Any real number is accepted (``int``, ``float``, NumPy scalars such as ``np.float32``, as
    for ``noise_multiplier``); ``bool`` and tensors are refused with a TypeError.
    ``+inf`` is accepted (no clipping); it can only be combined with ``noise_multiplier=0``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive real number (int, float or NumPy scalar), got "
            f"{type(value).__name__} ({value!r}); pass a tensor as float(tensor)"
        )
    value = float(value)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 (the clipping bound C), got {value!r}")
    return value


def _factor(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """``min(1, bound / (norms + 1e-6))`` elementwise, in at least float32."""
    norms = norms.to(sum_dtype(norms.dtype))
    return (bound / (norms + CLIP_EPSILON)).clamp(max=1.0)


def total_norms(per_param_norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sqrt(Σ_l n_il²)``: the norm of each sample's whole gradient, from its per-tensor norms
    (on the first tensor's device, in at least float32)."""
    device = per_param_norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=sum_dtype(n.dtype)) for n in per_param_norms], dim=1)
    return stacked.norm(2, dim=1)


def copies_per_tensor(factor: torch.Tensor, per_param_norms: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """One copy of the per-sample ``factor`` for each tensor, on the device of its norms."""
    return [factor.to(n.device) for n in per_param_norms]


def flat_factors(per_param_norms: Sequence[torch.Tensor], bound: float) -> List[torch.Tensor]:
    """The flat factors ``min(1, C / (‖g_i‖ + 1e-6))``, one copy per tensor on its device."""
    if not per_param_norms:
        return []
    return copies_per_tensor(_factor(total_norms(per_param_norms), bound), per_param_norms)


class Clipper(abc.ABC):
    """Strategy interface: ``clip_factors(norms)``, ``sensitivity`` and the capabilities the
    optimizer asks (defaults: one flat bound, fixed during training)."""

    sensitivity: float

    @abc.abstractmethod
    def clip_factors(self, per_param_norms: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """One ``(B,)`` factor tensor per trainable tensor, from its ``(B,)`` norms."""

    def check_num_params(self, num_params: int) -> None:
        """Raise ValueError if this clipper cannot handle ``num_params`` tensors."""

    def observe(self, per_param_norms: Sequence[torch.Tensor]) -> None:
        """See the norms of one backward pass of the logical batch (a fixed bound needs nothing)."""

    def take_observation(self) -> Optional[torch.Tensor]:
        """The statistic the step releases with the gradient (None for a fixed bound)."""
        return None

    def forget_observations(self) -> None:
        """Drop what :meth:`observe` gathered for a logical batch that is not stepped."""

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """The part of the step's noise multiplier ``σ`` that goes to the gradient sum: all of
        it, unless the clipper releases a statistic of its own (adaptive clipping)."""
        return noise_multiplier

    def state_dict(self) -> dict:
        """What the clipper learns during training (nothing for a fixed bound)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    # ------------------------------------------------------------------ capabilities
    @property
    def per_tensor(self) -> bool:
        """Whether a tensor's factors depend only on its own norms (then :meth:`factor_of`
        works and a tensor's clipped sum may be formed during the backward pass)."""
        return False

    def factor_of(self, index: int, norms: torch.Tensor) -> torch.Tensor:
        """The ``(B,)`` factors of trainable tensor ``index`` from its own norms (per-tensor
        clippers only)."""
        raise TypeError(
            f"{type(self).__name__} is not a per-tensor clipper (per_tensor is False): its factors "
            "need the norms of every tensor; call clip_factors(per_param_norms)")

    @property
    def bounds(self) -> List[float]:
        """One clipping bound per trainable tensor (per-layer), else ``[C]``."""
        return [self.sensitivity]

    def with_bound(self, value) -> "Clipper":
        """This rule with the flat bound ``value`` (``optimizer.max_grad_norm = value``)."""
        raise ValueError(FLAT_ONLY)

    def with_bounds(self, values: Sequence[float]) -> "Clipper":
        """Per-layer clipping to ``values`` (``optimizer.max_grad_norms = values``)."""
        return PerLayerClipper(values)

    def shared_settings(self) -> Dict[str, Optional[float]]:
        """Settings beyond σ and C that every process of a distributed run must share; the same
        names (:data:`SHARED_SETTING_NAMES`) for every clipper, ``None`` where unused."""
        return dict.fromkeys(SHARED_SETTING_NAMES)

    @property
    def releases_statistic(self) -> bool:
        """Whether the step releases a noisy statistic of the clipper's own
        (:meth:`take_observation`) besides the gradient sum."""
        return False


class FlatClipper(Clipper):
    """Clip the whole per-sample gradient (all tensors concatenated) to norm ``C``.

    ``f_i = min(1, C / (sqrt(Σ_l n_il²) + 1e-6))`` for every tensor; sensitivity ``C``.
    """

    def __init__(self, max_grad_norm: float):
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def clip_factors(self, per_param_norms):
        return flat_factors(per_param_norms, self.max_grad_norm)

    def with_bound(self, value) -> "FlatClipper":
        return FlatClipper(value)

    def __repr__(self):
        return f"FlatClipper(max_grad_norm={self.max_grad_norm})"


class PerLayerClipper(Clipper):
    """Clip each trainable tensor ``l`` separately to its own bound ``C_l``.

    ``f_il = min(1, C_l / (n_il + 1e-6))``. One sample changes the summed gradient by at
    most ``sqrt(Σ_l C_l²)`` in L2, so the sensitivity is ``‖C‖₂`` (McMahan et al. 2018,
    "A General Approach to Adding Differential Privacy to Iterative Training Procedures").
    """

    def __init__(self, max_grad_norms: Sequence[float]):
        if isinstance(max_grad_norms, numbers.Real) or not len(max_grad_norms):
            raise ValueError(
                "max_grad_norm for per-layer clipping must be a non-empty list with one "
                f"bound per trainable tensor, got {max_grad_norms!r}"
            )
        self.max_grad_norms = [
            check_max_grad_norm(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norms)
        ]

    @property
    def sensitivity(self) -> float:
        return math.sqrt(sum(c * c for c in self.max_grad_norms))

    def check_num_params(self, num_params: int) -> None:
        if num_params != len(self.max_grad_norms):
            raise ValueError(
                f"max_grad_norm has {len(self.max_grad_norms)} entries but there are "
                f"{num_params} trainable tensors: per-layer clipping needs one bound per "
                "trainable parameter tensor, in the order of optimizer.param_groups"
            )

    def clip_factors(self, per_param_norms):
        self.check_num_params(len(per_param_norms))
        return [_factor(n, c) for n, c in zip(per_param_norms, self.max_grad_norms)]

    @property
    def per_tensor(self) -> bool:
        return True

    def factor_of(self, index: int, norms: torch.Tensor) -> torch.Tensor:
        """``min(1, C_index / (n_i + 1e-6))``: tensor ``index``'s factors from its own norms."""
        return _factor(norms, self.max_grad_norms[index])

    def factor(self, index: int, norms: torch.Tensor) -> torch.Tensor:
        """:meth:`factor_of` (the earlier name)."""
        return self.factor_of(index, norms)

    @property
    def bounds(self) -> List[float]:
        return list(self.max_grad_norms)

    def __repr__(self):
        return f"PerLayerClipper(max_grad_norms={self.max_grad_norms})"
