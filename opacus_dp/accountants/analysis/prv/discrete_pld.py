r"""A privacy loss distribution (PLD) on a uniform grid, and its (ε, δ) curve.

For a pair of output distributions (P, Q) the privacy loss is L = log(dP/dQ) evaluated at
an output drawn from P.  The hockey-stick divergence, i.e. the smallest δ for which the pair
is (ε, δ)-indistinguishable, is (Sommer, Meiser & Mohammadi 2019, "Privacy loss classes")

.. math::  \delta(\varepsilon) = P(L = \infty) + \mathbb{E}_P\big[(1 - e^{\varepsilon - L})_+\big].

Here L takes the values ``(offset + k)·grid_step`` with probabilities ``pmf[k]`` plus the value
+∞ with probability ``infinity_mass``.  ``roundoff`` is a per-bin allowance for floating point
noise left by an FFT; it is added to every bin above ε, which can only increase δ(ε).
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter


@dataclass(frozen=True)
class DiscretePLD:
    """Privacy loss distribution on the grid ``(offset + k)·grid_step``, k = 0..len(pmf)-1."""

    grid_step: float
    offset: int
    pmf: np.ndarray
    infinity_mass: float = 0.0
    roundoff: float = 0.0

    @property
    def losses(self) -> np.ndarray:
        """The loss value of every bin of ``pmf``."""
        return (self.offset + np.arange(self.pmf.size)) * self.grid_step


def _upper_part(pld: DiscretePLD):
    """Masses of the bins with loss ≥ 0 (padding so that loss 0 is bin 0), plus the losses."""
    first = max(0, -pld.offset)
    masses = np.clip(pld.pmf[first:], 0.0, None) + pld.roundoff
    losses = (pld.offset + first + np.arange(masses.size)) * pld.grid_step
    return masses, losses


def _tail_sums(masses: np.ndarray, grid_step: float):
    """For every bin k: S_k = Σ_{j>k} m_j and G_k = Σ_{j>k} m_j e^{ℓ_k − ℓ_j}.

    G obeys G_{k-1} = e^{-h}(G_k + m_k); it is run as a stable first-order recursive filter.
    """
    reversed_masses = masses[::-1]
    above = np.concatenate(([0.0], np.cumsum(reversed_masses)[:-1]))[::-1]
    decay = math.exp(-grid_step)
    shifted = np.concatenate(([0.0], reversed_masses[:-1]))
    weighted = lfilter([decay], [1.0, -decay], shifted)[::-1]
    return above, weighted


def delta_for_epsilon(pld: DiscretePLD, epsilon: float) -> float:
    """δ(ε) of the discrete PLD (exact for the stored masses, see module docstring)."""
    masses, losses = _upper_part(pld)
    keep = losses > epsilon
    tail = masses[keep] * -np.expm1(epsilon - losses[keep])
    return float(min(1.0, pld.infinity_mass + tail.sum()))


def epsilon_for_delta(pld: DiscretePLD, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ ``delta``; ``inf`` if the mass at +∞ alone exceeds ``delta``."""
    if pld.infinity_mass > delta:
        return math.inf
    masses, losses = _upper_part(pld)
    if masses.size == 0:
        return 0.0
    above, weighted = _tail_sums(masses, pld.grid_step)
    delta_at_grid = pld.infinity_mass + above - weighted  # δ(ℓ_k)
    if pld.offset > 0:
        if delta_for_epsilon(pld, 0.0) <= delta:
            return 0.0
    elif delta_at_grid[0] <= delta:
        return 0.0
    candidates = np.flatnonzero(delta_at_grid <= delta)
    if candidates.size == 0:
        return float(losses[-1])
    k = int(candidates[0])
    # On (ℓ_{k-1}, ℓ_k]:  δ(ε) = p∞ + Σ_{j≥k} m_j − e^{ε} Σ_{j≥k} m_j e^{−ℓ_j}
    numerator = pld.infinity_mass + above[k] + masses[k] - delta
    denominator = masses[k] + weighted[k]
    epsilon = losses[k] + math.log(numerator / denominator) if numerator > 0 else losses[k]
    lower = losses[k - 1] if k > 0 else 0.0
    return float(min(max(epsilon, lower, 0.0), losses[k]))
