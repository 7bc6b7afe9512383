"""Automatic clipping: every per-sample gradient is normalised instead of clipped.

Bu, Wang, Zha & Karypis 2022, "Automatic Clipping: Differentially Private Deep Learning Made
Easier and Stronger" (AUTO-S). With ``‖g_i‖`` the norm of sample ``i``'s whole gradient (all
trainable tensors) and a stability constant ``γ > 0``:

    f_i = C / (‖g_i‖ + γ)

so ``‖f_i g_i‖ = C · ‖g_i‖ / (‖g_i‖ + γ) < C`` for every sample: the sensitivity is ``C``, as
for flat clipping, and the noise std is ``σ · C``. Unlike ``min(1, C / ‖g_i‖)`` no gradient is
left at its own length, so ``C`` only scales the update (the paper sets it to 1 and lets the
learning rate absorb it). A dropped sample (norm ``+inf``, :mod:`opacus_dp.optim.nonfinite`)
gets ``f_i = C / ∞ = 0``.

:class:`NormalisingClipper` is the shared frame of this rule and PSAC
(:mod:`opacus_dp.optim.psac_clipping`): ``f_i = C / (‖g_i‖ + d(‖g_i‖))`` with ``d > 0``.
"""

import abc
import math
from typing import Dict, Optional, Sequence, Union

import torch

from opacus_dp.accountants.validation import as_real
from opacus_dp.maths.per_sample import sum_dtype
from opacus_dp.optim.clipping import (
    AUTOMATIC_GAMMA_SETTING,
    Clipper,
    check_max_grad_norm,
    copies_per_tensor,
    total_norms,
)

DEFAULT_GAMMA = 0.01  # the paper's stability constant


def check_stability_constant(value, name: str) -> float:
    """``value`` as float if it is a finite real number > 0, else an error naming ``name``."""
    value = as_real(value, name)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (the rule's stability constant), got {value!r}")
    return value


class NormalisingClipper(Clipper):
    """Flat rule ``f_i = C / (‖g_i‖ + d(‖g_i‖))`` with ``d > 0``: ``‖f_i g_i‖ < C``, sensitivity ``C``.

    Subclasses name their constant (``option``: the keyword, ``setting``: its key in
    :meth:`shared_settings`) and give ``d`` (:meth:`offset`).
    """

    option: str
    setting: str

    def __init__(self, max_grad_norm: float, constant: float):
        bound = check_max_grad_norm(max_grad_norm)
        if math.isinf(bound):
            raise ValueError(
                f"max_grad_norm must be finite for {type(self).__name__}: it scales every clipped "
                "gradient (f_i = C / (‖g_i‖ + ...)); pass a finite C, e.g. 1.0")
        self.max_grad_norm = bound
        self.constant = check_stability_constant(constant, self.option)

    @abc.abstractmethod
    def offset(self, norms: torch.Tensor) -> Union[torch.Tensor, float]:
        """``d(‖g_i‖) > 0``, added to the norm in the factor's denominator."""

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def factors(self, norms: torch.Tensor) -> torch.Tensor:
        """``C / (‖g_i‖ + d(‖g_i‖))`` elementwise, in at least float32 (0 for ``‖g_i‖ = +inf``)."""
        norms = norms.to(sum_dtype(norms.dtype))
        return self.max_grad_norm / (norms + self.offset(norms))

    def clip_factors(self, per_param_norms):
        if not per_param_norms:
            return []
        return copies_per_tensor(self.factors(total_norms(per_param_norms)), per_param_norms)

    def with_bound(self, value) -> "NormalisingClipper":
        """The same rule and constant with the bound ``value``."""
        return type(self)(value, self.constant)

    def with_bounds(self, values: Sequence[float]) -> Clipper:
        raise ValueError(
            f"optimizer.max_grad_norms cannot be set for {type(self).__name__}: it normalises the "
            "whole per-sample gradient to one bound; set optimizer.max_grad_norm instead")

    def shared_settings(self) -> Dict[str, Optional[float]]:
        return {**super().shared_settings(), self.setting: self.constant}

    def __repr__(self):
        return f"{type(self).__name__}(max_grad_norm={self.max_grad_norm}, {self.option}={self.constant})"


class AutomaticClipper(NormalisingClipper):
    """Automatic clipping (AUTO-S, module doc): ``f_i = C / (‖g_i‖ + γ)``.

    Args:
        max_grad_norm: ``C`` (finite), which scales every clipped gradient.
        gamma: the stability constant ``γ > 0`` (default 0.01, the paper's).
    """

    option = "gamma"
    setting = AUTOMATIC_GAMMA_SETTING

    def __init__(self, max_grad_norm: float, gamma: float = DEFAULT_GAMMA):
        super().__init__(max_grad_norm, gamma)

    @property
    def gamma(self) -> float:
        return self.constant

    def offset(self, norms: torch.Tensor) -> float:
        return self.constant
