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

LAMBDAS = np.logspace(-4.0, 4.0, 17)  # exponents tried in Chernoff bounds
_MGF_BLOCKS = 1 << 15
_MGF_TOTAL_SHIFT = 0.5  # loss units
_DOMINANT_MASS = 0.5
_NEGLIGIBLE = -60.0


def _blocked(pld: DiscretePLD, upward: bool, max_shift: float):
    """(loss, mass) pairs with blocks of bins merged onto their highest loss (``upward``) or
    lowest loss, which can only increase E[e^{λL}] for λ > 0 (resp. λ < 0).  Blocks span at
    most ``max_shift`` in loss and the result has at most about ``_MGF_BLOCKS`` pairs."""
    losses, pmf = pld.losses, pld.pmf
    width = max(1, min(-(-pmf.size // _MGF_BLOCKS), int(max_shift / pld.grid_step)))
    if width == 1:
        return losses, pmf
    padded = np.concatenate((pmf, np.zeros(-pmf.size % width)))
    masses = padded.reshape(-1, width).sum(axis=1)
    starts = losses[0] + np.arange(masses.size) * width * pld.grid_step
    return (starts + (width - 1) * pld.grid_step if upward else starts), masses


def log_mgf_bound(pld: DiscretePLD, lambdas: np.ndarray, max_shift: float) -> np.ndarray:
    """Upper bound on log E[e^{λL}; L finite] for every λ (all λ of one sign); exact when
    ``max_shift`` is below the grid step."""
    losses, masses = _blocked(pld, bool(lambdas[0] > 0), max_shift)
    positive = masses > 0
    log_p, losses = np.log(masses[positive]), losses[positive]
    result = np.empty(lambdas.size)
    dropped_bound = math.log1p(losses.size * math.exp(_NEGLIGIBLE))  # terms below e^-60 × top
    for i, lam in enumerate(lambdas):
        exponents = log_p + lam * losses
        top = exponents.max()
        kept = exponents[exponents > top + _NEGLIGIBLE]
        result[i] = top + math.log(np.exp(kept - top).sum()) + dropped_bound
    return result


def chernoff_window(segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float) -> Tuple[float, float]:
    """Losses (a, b) with P(S < a) ≤ tail_mass and P(S > b) ≤ tail_mass for S = Σ_s Σ_{t≤T_s} L.

    Merging bins to speed up the MGF moves each step's loss by less than
    ``_MGF_TOTAL_SHIFT / (T_s · #segments)``, so the window widens by less than ``_MGF_TOTAL_SHIFT``.
    """
    log_tail = math.log(tail_mass)
    lambdas = LAMBDAS
    shift = _MGF_TOTAL_SHIFT / len(segments)
    up = sum(count * log_mgf_bound(pld, lambdas, shift / count) for pld, count in segments)
    down = sum(count * log_mgf_bound(pld, -lambdas, shift / count) for pld, count in segments)
    upper = float(np.min((up - log_tail) / lambdas))
    lower = float(np.max((log_tail - down) / lambdas))
    support_low = sum(count * pld.losses[0] for pld, count in segments)
    support_high = sum(count * pld.losses[-1] for pld, count in segments)
    return max(lower, support_low), min(upper, support_high)


def window_bins(window: Tuple[float, float], grid_step: float) -> int:
    """Number of grid bins needed to hold the losses ``window = (low, high)``."""
    return int(math.ceil(window[1] / grid_step) - math.floor(window[0] / grid_step)) + 1


def _log1p_complex(w: np.ndarray) -> np.ndarray:
    """log(1 + w) for complex w, accurate for small |w| (real part via log1p)."""
    x, y = w.real, w.imag
    with np.errstate(divide="ignore"):
        real = np.where(np.abs(w) < 0.5, 0.5 * np.log1p(2 * x + x * x + y * y), np.log(np.abs(1 + w)))
    return real + 1j * np.arctan2(y, 1 + x)


def _phase(shift: int, size: int) -> np.ndarray:
    """e^{−iω·shift} at the rFFT frequencies ω_m = 2πm/size (exact integer reduction)."""
    m = np.arange(size // 2 + 1, dtype=np.int64)
    return np.exp(-2j * np.pi * ((m * (shift % size)) % size) / size)


def _log_power_spectrum(pld: DiscretePLD, count: int, size: int):
    """(count·log φ(ω) without the heaviest bin's phase, count × that bin's circular index).

    When one bin holds most of the mass p₀ (a step that rarely touches the record),
    φ(ω) = e^{−iωk₀}·p₀·(1 + w(ω)) with w = (rFFT of the other bins)·e^{iωk₀}/p₀: the rounding
    error of 1 + w is relative to the small masses, not to 1, so raising φ to a large power
    ``count`` (as exp(count·log φ)) does not amplify the rounding of the heaviest bin.
    """
    positions = (pld.offset + np.arange(pld.pmf.size)) % size
    heaviest = int(np.argmax(pld.pmf))
    p0 = float(pld.pmf[heaviest])
    if p0 < _DOMINANT_MASS:  # no dominant bin: the plain spectrum is as accurate
        spectrum = sp_fft.rfft(np.bincount(positions, weights=pld.pmf, minlength=size))
        with np.errstate(divide="ignore"):
            return count * np.log(spectrum), 0
    rest = pld.pmf.copy()
    rest[heaviest] = 0.0
    k0 = int(positions[heaviest])
    w = sp_fft.rfft(np.bincount(positions, weights=rest, minlength=size)) / _phase(k0, size) / p0
    return count * (math.log(p0) + _log1p_complex(w)), count * k0


def circular_composition(segments: Sequence[Tuple[DiscretePLD, int]], window: Tuple[float, float]):
    """(first grid index, raw PMF of the composition on the window's bins, not yet clipped).

    Bin k holds the mass of all sums ≡ first + k modulo the FFT size (circular aliasing).
    """
    grid_step = segments[0][0].grid_step
    if any(pld.grid_step != grid_step for pld, _ in segments):
        raise ValueError("all PLDs composed together must share the same grid_step")
    first = math.floor(window[0] / grid_step)
    size = sp_fft.next_fast_len(math.ceil(window[1] / grid_step) - first + 1, real=True)
    log_spectrum, shift = np.zeros(size // 2 + 1, dtype=complex), 0
    for pld, count in segments:
        part, part_shift = _log_power_spectrum(pld, count, size)
        log_spectrum += part
        shift += part_shift
    circular = sp_fft.irfft(np.exp(log_spectrum) * _phase(shift, size), n=size)
    return first, np.roll(circular, -(first % size))


def finite_mass_log(segments: Sequence[Tuple[DiscretePLD, int]]) -> float:
    """log P(no step hits the loss +∞) = Σ_s T_s log(1 − p∞_s)."""
    return sum(count * math.log1p(-pld.infinity_mass) for pld, count in segments)


def compose(
    segments: Sequence[Tuple[DiscretePLD, int]], tail_mass: float, window: Tuple[float, float]
) -> DiscretePLD:
    """PLD of the composition of ``count`` copies of each segment's PLD (same grid step).

    ``window`` must come from :func:`chernoff_window` with the same ``tail_mass``.  Negative
    round-off is clipped and its largest magnitude kept as the per-bin ``roundoff`` allowance.
    """
    first, pmf = circular_composition(segments, window)
    return DiscretePLD(
        grid_step=segments[0][0].grid_step,
        offset=first,
        pmf=np.clip(pmf, 0.0, None),
        infinity_mass=min(1.0, -math.expm1(finite_mass_log(segments)) + tail_mass),
        roundoff=float(max(0.0, -pmf.min())),
    )
