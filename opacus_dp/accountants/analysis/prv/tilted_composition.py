r"""Composition by FFT under exponential tilting, for accurate tails (tiny δ, many steps).

A plain FFT composition of T steps carries round-off of about T·2⁻⁵² relative to the largest
bin, which swamps bins far in the tail.  Tilting (Esscher transform) moves the bulk there:
with :math:`K(\theta) = \log \sum_j p_j e^{\theta \ell_j}` and the tilted step PMF
:math:`\tilde p_j = p_j e^{\theta \ell_j - K(\theta)}`, the composition obeys

.. math::  p^{*T}(s) = \tilde p^{*T}(s)\, e^{T K(\theta) - \theta s},

so the round-off is relative to the tilted bulk, which sits near ε for the θ chosen by
:func:`tilt_candidates`.  Aliasing stays pessimistic: wrapped-around tilted mass only adds
positive mass to bins; the untilted mass above the window is bounded by Chernoff and charged
to the infinite loss; the round-off allowance (largest negative round-off) is added to every
bin before untilting.
"""

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from opacus_dp.accountants.analysis.prv.composition import (
    LAMBDAS,
    log_mgf_bound,
    chernoff_window,
    circular_composition,
    finite_mass_log,
)
from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD

_MAX_EXPONENT = 700.0
_TILTS = np.logspace(-4.0, 4.0, 49)


def _exactlog_mgf_bound(pld: DiscretePLD, theta: float) -> float:
    positive = pld.pmf > 0
    exponents = np.log(pld.pmf[positive]) + theta * pld.losses[positive]
    top = exponents.max()
    return float(top + math.log(np.exp(exponents - top).sum()))


def _tilted(pld: DiscretePLD, theta: float) -> Tuple[DiscretePLD, float]:
    """(the tilted, normalised finite part of ``pld``, K(θ) of that finite part)."""
    log_mgf = _exactlog_mgf_bound(pld, theta)
    with np.errstate(divide="ignore"):
        pmf = np.exp(np.log(pld.pmf) + theta * pld.losses - log_mgf)
    return DiscretePLD(grid_step=pld.grid_step, offset=pld.offset, pmf=pmf), log_mgf


def tilt_candidates(segments: Sequence[Tuple[DiscretePLD, int]], delta: float) -> np.ndarray:
    """Tilts θ to try, best first: the θ of the tightest exponential bound on δ(ε), then smaller.

    As (1 − e^{ε−L})_+ ≤ c_θ e^{θ(L−ε)} with c_θ = (θ/(1+θ))^θ / (1+θ), δ(ε) ≤ c_θ e^{ΣT_sK_s(θ) − θε};
    the θ minimising the implied ε = (ΣT_sK_s(θ) + log c_θ − log δ)/θ is the saddle point near
    which the composed loss decides δ.  Smaller θ give narrower tilted windows.
    """
    up = sum(count * log_mgf_bound(pld, _TILTS, 0.0) for pld, count in segments)
    log_c = _TILTS * (np.log(_TILTS) - np.log1p(_TILTS)) - np.log1p(_TILTS)
    best = int(np.argmin((up + log_c - math.log(delta)) / _TILTS))
    return _TILTS[best::-1]


def _untilted_tail_above(segments: Sequence[Tuple[DiscretePLD, int]], high: float) -> float:
    """Chernoff bound on the (untilted) probability that the finite composed loss exceeds ``high``."""
    if high >= sum(count * pld.losses[-1] for pld, count in segments):
        return 0.0
    up = sum(count * log_mgf_bound(pld, LAMBDAS, 0.0) for pld, count in segments)
    return float(min(1.0, math.exp(min(0.0, float(np.min(up - LAMBDAS * high))))))


def _fitting_tilt(segments, tail_mass: float, delta: float, max_bins: int):
    """(θ, tilted segments, Σ T_s K_s(θ), window) for the best tilt whose window fits."""
    grid_step = segments[0][0].grid_step
    for theta in tilt_candidates(segments, delta):
        tilted = [(_tilted(pld, theta), count) for pld, count in segments]
        tilted_segments = [(pld, count) for (pld, _), count in tilted]
        window = chernoff_window(tilted_segments, tail_mass)
        if (window[1] - window[0]) / grid_step + 1 <= max_bins:
            log_scale = sum(count * log_mgf for (_, log_mgf), count in tilted)
            return float(theta), tilted_segments, log_scale, window
    return None


def compose_tilted(
    segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float, delta: float, max_bins: int
) -> Optional[DiscretePLD]:
    """Composed PLD computed under a tilt suited to ``delta``; ``None`` when no tilt fits in
    ``max_bins`` bins or the untilting factors would overflow."""
    fitting = _fitting_tilt(segments, tail_mass, delta, max_bins)
    if fitting is None:
        return None
    theta, tilted_segments, log_scale, window = fitting
    grid_step = segments[0][0].grid_step
    first, raw = circular_composition(tilted_segments, window)
    exponent = log_scale - theta * (first + np.arange(raw.size)) * grid_step
    if exponent.max() > _MAX_EXPONENT:
        return None
    allowance = max(0.0, -raw.min())
    pmf = (np.clip(raw, 0.0, None) + allowance) * np.exp(exponent)
    infinity = -math.expm1(finite_mass_log(segments)) + _untilted_tail_above(segments, window[1])
    return DiscretePLD(grid_step=grid_step, offset=first, pmf=pmf, infinity_mass=min(1.0, infinity))
