r"""Pessimistic grid PLD of one step of the Poisson-subsampled Gaussian mechanism.

With A = N(0, σ²), B = N(1, σ²) and the mixture M = (1 − q)A + qB, the two dominating
pairs under add/remove-one adjacency are (Zhu, Dong & Wang 2022, "Optimal accounting of
differential privacy via characteristic function", Sec. 5):

* ``"remove"``: (P, Q) = (M, A), likelihood ratio X(x) = (1 − q) + q·e^{(2x − 1)/(2σ²)};
* ``"add"``:    (P, Q) = (A, M), likelihood ratio X(x) = 1 / ((1 − q) + q·e^{(2x − 1)/(2σ²)}).

Discretisation ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022,
"Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions"): on the
grid α_i = e^{i·h}, the Q-mass of outputs with α_i < X ≤ α_{i+1} is split between α_i and
α_{i+1} with weights linear in X, so that E_Q[X] is kept.  The discrete likelihood ratio is a
mean-preserving spread of the true one, hence E_Q[f(X)] can only grow for convex f, in
particular every hockey-stick divergence E_Q[(X − e^ε)_+]; the discrete pair dominates the
true pair (also after composition).  In P-masses, an interval J sends
α_{i+1}(P(J) − α_i Q(J))/(α_{i+1} − α_i) to α_{i+1} and α_i(α_{i+1}Q(J) − P(J))/(α_{i+1} − α_i)
to α_i.  P-mass above the top grid point goes to L = +∞ (pessimistic); P-mass below the
lowest point α_lo is split between X = 0 (no P-mass) and α_lo, i.e. put on α_lo.
"""

import math

import numpy as np
from scipy import special

from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD

DIRECTIONS = ("remove", "add")


def _gaussian_interval_mass(lower: np.ndarray, upper: np.ndarray, mean: float, sigma: float):
    """N(mean, σ²)([lower, upper]) with relative accuracy in both tails."""
    a = (lower - mean) / sigma
    b = (upper - mean) / sigma
    right_tail = special.ndtr(-a) - special.ndtr(-b)
    left_tail = special.ndtr(b) - special.ndtr(a)
    return np.where(a > 0, right_tail, left_tail)


def _log_mixture_ratio(x: np.ndarray, q: float, sigma: float) -> np.ndarray:
    """log((1 − q) + q·e^{(2x − 1)/(2σ²)}), the loss of the ``remove`` pair at output x."""
    t = (2 * x - 1) / (2 * sigma**2)
    if q == 1.0:
        return t
    return np.logaddexp(math.log1p(-q), math.log(q) + t)


def _x_at_mixture_ratio(log_ratio: np.ndarray, q: float, sigma: float) -> np.ndarray:
    """The x with (1 − q) + q·e^{(2x−1)/(2σ²)} = e^{log_ratio}; −∞ where no such x exists."""
    excess = np.expm1(log_ratio) + q  # (e^r − (1 − q)), computed without cancellation
    with np.errstate(divide="ignore", invalid="ignore"):
        x = sigma**2 * (np.log(excess) - math.log(q)) + 0.5
    return np.where(excess > 0, x, -np.inf)


def loss_range(sigma: float, q: float, direction: str, tail_mass: float):
    """Interval of losses holding all but ≤ 2·``tail_mass`` of P (one ``tail_mass`` per side)."""
    z = -special.ndtri(tail_mass)
    outer = np.array([-sigma * z, 1.0 + sigma * z])
    losses = _log_mixture_ratio(outer, q, sigma)
    if direction == "add":
        outer = np.array([-sigma * z, sigma * z])
        losses = -_log_mixture_ratio(outer, q, sigma)[::-1]
    return float(losses[0]), float(losses[1])


def _interval_masses(grid_x: np.ndarray, q: float, sigma: float):
    """A- and B-masses of the x-intervals between consecutive grid points (sorted x)."""
    lower, upper = np.minimum(grid_x[:-1], grid_x[1:]), np.maximum(grid_x[:-1], grid_x[1:])
    return _gaussian_interval_mass(lower, upper, 0.0, sigma), _gaussian_interval_mass(lower, upper, 1.0, sigma)


def _pair_coefficients(q: float, direction: str):
    """(P, Q) as combinations of (A, B): ((p_a, p_b), (q_a, q_b))."""
    mixture, pure = (1.0 - q, q), (1.0, 0.0)
    return (mixture, pure) if direction == "remove" else (pure, mixture)


def _grid_x(indices: np.ndarray, grid_step: float, q: float, sigma: float, direction: str):
    """Output x at which the likelihood ratio equals α_i = e^{i·h} (±∞ outside its range)."""
    log_alpha = indices * grid_step
    if direction == "remove":
        return _x_at_mixture_ratio(log_alpha, q, sigma)
    return _x_at_mixture_ratio(-log_alpha, q, sigma)  # X ≥ α  ⟺  x ≤ this value


def _outer_masses(grid_x: np.ndarray, q: float, sigma: float, direction: str):
    """P-mass above the top grid point and below the lowest grid point."""
    (p_a, p_b), _ = _pair_coefficients(q, direction)
    low_x, high_x = grid_x[0], grid_x[-1]  # x at the lowest and at the highest α
    if direction == "add":  # X decreasing in x: large X ↔ small x
        above = p_a * special.ndtr(high_x / sigma) + p_b * special.ndtr((high_x - 1) / sigma)
        below = p_a * special.ndtr(-low_x / sigma) + p_b * special.ndtr(-(low_x - 1) / sigma)
    else:
        above = p_a * special.ndtr(-high_x / sigma) + p_b * special.ndtr(-(high_x - 1) / sigma)
        below = p_a * special.ndtr(low_x / sigma) + p_b * special.ndtr((low_x - 1) / sigma)
    return float(above), float(below)


def subsampled_gaussian_pld(
    sigma: float, q: float, grid_step: float, direction: str, tail_mass: float
) -> DiscretePLD:
    """Dominating grid PLD of one Poisson-subsampled Gaussian step (0 < q ≤ 1, σ > 0)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    low, high = loss_range(sigma, q, direction, tail_mass)
    indices = np.arange(math.floor(low / grid_step), math.ceil(high / grid_step) + 1, dtype=float)
    grid_x = _grid_x(indices, grid_step, q, sigma, direction)
    mass_a, mass_b = _interval_masses(grid_x, q, sigma)
    (p_a, p_b), (q_a, q_b) = _pair_coefficients(q, direction)
    alpha_low = np.exp(indices[:-1] * grid_step)
    alpha_high = np.exp(indices[1:] * grid_step)
    excess_low = (p_a - alpha_low * q_a) * mass_a + (p_b - alpha_low * q_b) * mass_b  # P(J) − α_i Q(J)
    excess_high = (alpha_high * q_a - p_a) * mass_a + (alpha_high * q_b - p_b) * mass_b  # α_{i+1}Q(J) − P(J)
    # α_{i+1}/(α_{i+1} − α_i) = 1/(1 − e^{−h});  α_i/(α_{i+1} − α_i) = 1/(e^h − 1)
    to_upper = np.clip(excess_low, 0.0, None) / -math.expm1(-grid_step)
    to_lower = np.clip(excess_high, 0.0, None) / math.expm1(grid_step)
    pmf = np.zeros(indices.size)
    pmf[1:] += to_upper
    pmf[:-1] += to_lower
    above, below = _outer_masses(grid_x, q, sigma, direction)
    pmf[0] += below
    return DiscretePLD(grid_step=grid_step, offset=int(indices[0]), pmf=pmf, infinity_mass=above)
