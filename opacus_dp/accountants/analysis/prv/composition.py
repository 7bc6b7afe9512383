r"""Composition of grid PLDs by FFT, with a window chosen by Chernoff bounds.

The loss of a composition is the sum of independent per-step losses, so its PMF is the
convolution of the per-step PMFs; for ``T`` identical steps it is the T-th convolution power,
computed as an inverse FFT of the T-th power of the (discrete) characteristic function
(Koskela, Jälkö & Honkela 2020, "Computing tight differential privacy guarantees using FFT").

The FFT is circular: a sum outside the window [a, b] reappears inside it (aliasing).  The
window is chosen so that, by the Chernoff bound
:math:`P(S \ge b) \le \exp(\sum_s T_s K_s(\lambda) - \lambda b)` (K_s the log-MGF of step s),
at most ``tail_mass`` lies above b and at most ``tail_mass`` below a.  The upper bound is added to
the mass at +∞; aliased mass only adds to bins, so δ(ε) can only be over-estimated.
"""

import math
from typing import Sequence, Tuple

import numpy as np
from scipy import fft as sp_fft

from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD

_LAMBDAS = np.logspace(-4.0, 4.0, 33)
_MGF_BLOCKS = 1 << 15


def _blocked(pld: DiscretePLD, upward: bool):
    """At most ``_MGF_BLOCKS`` (loss, mass) pairs; each block's mass sits at its highest loss
    (``upward``) or lowest loss, which can only increase E[e^{λL}] for λ > 0 (resp. λ < 0)."""
    losses, pmf = pld.losses, pld.pmf
    width = -(-pmf.size // _MGF_BLOCKS)
    if width == 1:
        return losses, pmf
    padded = np.concatenate((pmf, np.zeros(-pmf.size % width)))
    masses = padded.reshape(-1, width).sum(axis=1)
    starts = losses[0] + np.arange(masses.size) * width * pld.grid_step
    return (starts + (width - 1) * pld.grid_step if upward else starts), masses


def _log_mgf(pld: DiscretePLD, lambdas: np.ndarray) -> np.ndarray:
    """Upper bound on log E[e^{λL}; L finite] for every λ (all λ of one sign)."""
    losses, masses = _blocked(pld, upward=bool(lambdas[0] > 0))
    positive = masses > 0
    log_p, losses = np.log(masses[positive]), losses[positive]
    result = np.empty(lambdas.size)
    for i, lam in enumerate(lambdas):
        exponents = log_p + lam * losses
        top = exponents.max()
        result[i] = top + math.log(np.exp(exponents - top).sum())
    return result


def chernoff_window(segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float) -> Tuple[float, float]:
    """Losses (a, b) with P(S < a) ≤ tail_mass and P(S > b) ≤ tail_mass for S = Σ_s Σ_{t≤T_s} L."""
    log_tail = math.log(tail_mass)
    up = sum(count * _log_mgf(pld, _LAMBDAS) for pld, count in segments)
    down = sum(count * _log_mgf(pld, -_LAMBDAS) for pld, count in segments)
    upper = float(np.min((up - log_tail) / _LAMBDAS))
    lower = float(np.max((log_tail - down) / _LAMBDAS))
    support_low = sum(count * pld.losses[0] for pld, count in segments)
    support_high = sum(count * pld.losses[-1] for pld, count in segments)
    return max(lower, support_low), min(upper, support_high)


def window_bins(window: Tuple[float, float], grid_step: float) -> int:
    """Number of grid bins needed to hold the losses ``window = (low, high)``."""
    return int(math.ceil(window[1] / grid_step) - math.floor(window[0] / grid_step)) + 1


def _folded_spectrum(pld: DiscretePLD, size: int) -> np.ndarray:
    """rFFT of the PMF placed circularly at its absolute grid indices modulo ``size``."""
    positions = (pld.offset + np.arange(pld.pmf.size)) % size
    folded = np.bincount(positions, weights=pld.pmf, minlength=size)
    return sp_fft.rfft(folded)


def compose(
    segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float, window: Tuple[float, float]
) -> DiscretePLD:
    """PLD of the composition of ``count`` copies of each segment's PLD (same grid step).

    ``window`` must come from :func:`chernoff_window` with the same ``tail_mass``.
    """
    grid_step = segments[0][0].grid_step
    if any(pld.grid_step != grid_step for pld, _ in segments):
        raise ValueError("all PLDs composed together must share the same grid_step")
    low, high = window
    first = math.floor(low / grid_step)
    size = sp_fft.next_fast_len(math.ceil(high / grid_step) - first + 1, real=True)
    spectrum = np.ones(size // 2 + 1, dtype=complex)
    for pld, count in segments:
        spectrum *= _folded_spectrum(pld, size) ** count
    circular = sp_fft.irfft(spectrum, n=size)
    pmf = np.roll(circular, -(first % size))
    roundoff = float(max(0.0, -pmf.min()))
    log_finite = sum(count * math.log1p(-pld.infinity_mass) for pld, count in segments)
    infinity = -math.expm1(log_finite) + tail_mass
    return DiscretePLD(
        grid_step=grid_step,
        offset=first,
        pmf=np.clip(pmf, 0.0, None),
        infinity_mass=min(1.0, infinity),
        roundoff=roundoff,
    )
