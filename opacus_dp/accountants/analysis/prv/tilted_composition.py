r"""Composition by FFT under exponential tilting, for accurate tails (tiny δ, many steps).

A plain FFT composition of T steps carries round-off of about T·2⁻⁵² relative to the largest
bin, which swamps bins far in the tail.  Tilting (Esscher transform) moves the bulk there:
with :math:`K(\theta) = \log \sum_j p_j e^{\theta \ell_j}` and the tilted step PMF
:math:`\tilde p_j = p_j e^{\theta \ell_j - K(\theta)}`, the composition obeys

.. math::  p^{*T}(s) = \tilde p^{*T}(s)\, e^{T K(\theta) - \theta s},

so the round-off is relative to the tilted bulk, which sits near ε when θ is the Chernoff
parameter for the tail δ.  Aliasing stays pessimistic: wrapped-around tilted mass only adds
positive mass to bins; the untilted mass above the window is bounded by Chernoff and charged
to the infinite loss; the round-off allowance is added to every bin after untilting.
"""

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from opacus_dp.accountants.analysis.prv.composition import (
    _LAMBDAS,
    _log_mgf,
    chernoff_window,
    circular_composition,
    finite_mass_log,
)
from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD

_MAX_EXPONENT = 700.0


def _exact_log_mgf(pld: DiscretePLD, theta: float) -> float:
    positive = pld.pmf > 0
    exponents = np.log(pld.pmf[positive]) + theta * pld.losses[positive]
    top = exponents.max()
    return float(top + math.log(np.exp(exponents - top).sum()))


def _tilted(pld: DiscretePLD, theta: float) -> Tuple[DiscretePLD, float]:
    """(the tilted, normalised finite part of ``pld``, K(θ) of that finite part)."""
    log_mgf = _exact_log_mgf(pld, theta)
    with np.errstate(divide="ignore"):
        pmf = np.exp(np.log(pld.pmf) + theta * pld.losses - log_mgf)
    return DiscretePLD(grid_step=pld.grid_step, offset=pld.offset, pmf=pmf), log_mgf


def chernoff_tilt(segments: Sequence[Tuple[DiscretePLD, int]], delta: float) -> float:
    """θ minimising the Chernoff bound (Σ T_s K_s(λ) − log δ)/λ on the loss tail of mass δ."""
    up = sum(count * _log_mgf(pld, _LAMBDAS, 0.0) for pld, count in segments)
    return float(_LAMBDAS[int(np.argmin((up - math.log(delta)) / _LAMBDAS))])


def _untilted_tail_above(segments: Sequence[Tuple[DiscretePLD, int]], high: float) -> float:
    """Chernoff bound on the (untilted) probability that the finite composed loss exceeds ``high``."""
    up = sum(count * _log_mgf(pld, _LAMBDAS, 0.0) for pld, count in segments)
    return float(min(1.0, math.exp(min(0.0, float(np.min(up - _LAMBDAS * high))))))


def compose_tilted(
    segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float, delta: float, max_bins: int
) -> Optional[DiscretePLD]:
    """Composed PLD computed under the tilt for tail ``delta``; ``None`` when it does not apply
    (the window would exceed ``max_bins`` or the untilting factors overflow)."""
    theta = chernoff_tilt(segments, delta)
    tilted = [(_tilted(pld, theta), count) for pld, count in segments]
    log_scale = sum(count * log_mgf for (_, log_mgf), count in tilted)
    tilted_segments = [(pld, count) for (pld, _), count in tilted]
    window = chernoff_window(tilted_segments, tail_mass)
    grid_step = segments[0][0].grid_step
    if (window[1] - window[0]) / grid_step + 1 > max_bins:
        return None
    first, raw = circular_composition(tilted_segments, window)
    exponent = log_scale - theta * (first + np.arange(raw.size)) * grid_step
    if exponent.max() > _MAX_EXPONENT:
        return None
    allowance = max(0.0, -raw.min())
    pmf = (np.clip(raw, 0.0, None) + allowance) * np.exp(exponent)
    infinity = -math.expm1(finite_mass_log(segments)) + _untilted_tail_above(segments, window[1])
    return DiscretePLD(grid_step=grid_step, offset=first, pmf=pmf, infinity_mass=min(1.0, infinity))
