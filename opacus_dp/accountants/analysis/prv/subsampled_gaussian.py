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
lowest point α_lo is split between X = 0 (no P-mass) and α_lo, i.e. put on α_lo.  The grid
never extends beyond per-step losses of ±500 (``LOSS_CAP``, to stay inside floating point
range); a step that loses more than that with probability > δ is reported as ε = ∞, which only
happens for σ of a few hundredths or less, where no meaningful guarantee exists anyway.
"""

import math

import numpy as np
from scipy import special

from opacus_dp.accountants.analysis.prv.discrete_pld import DiscretePLD

DIRECTIONS = ("remove", "add")
LOSS_CAP = 500.0  # per-step losses beyond ±LOSS_CAP are treated pessimistically (see module doc)


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
    log_ratio = np.asarray(log_ratio, dtype=float)
    near_one = log_ratio > -0.5  # e^r − (1 − q) without cancellation on both sides
    excess = np.where(near_one, np.expm1(np.where(near_one, log_ratio, 0.0)) + q, np.exp(log_ratio) - (1.0 - q))
    with np.errstate(divide="ignore", invalid="ignore"):
        x = sigma**2 * (np.log(excess) - math.log(q)) + 0.5
    return np.where(excess > 0, x, -np.inf)


def loss_range(sigma: float, q: float, direction: str, tail_mass: float):
    """Interval of losses holding all but ≤ 2·``tail_mass`` of P (one ``tail_mass`` per side),
    clipped to [−LOSS_CAP, LOSS_CAP]."""
    z = -special.ndtri(tail_mass)
    outer = np.array([-sigma * z, 1.0 + sigma * z])
    losses = _log_mixture_ratio(outer, q, sigma)
    if direction == "add":
        outer = np.array([-sigma * z, sigma * z])
        losses = -_log_mixture_ratio(outer, q, sigma)[::-1]
    return max(float(losses[0]), -LOSS_CAP), min(float(losses[1]), LOSS_CAP)


def _pair_coefficients(q: float, direction: str):
    """(P, Q) as combinations of (A, B): ((p_a, p_b), (q_a, q_b))."""
    mixture, pure = (1.0 - q, q), (1.0, 0.0)
    return (mixture, pure) if direction == "remove" else (pure, mixture)


def _grid_x(indices: np.ndarray, grid_step: float, q: float, sigma: float, direction: str):
    """Output x at which the likelihood ratio equals α_i = e^{i·h} (−∞ outside its range).

    remove: X increases with x, {X ≥ α} = [x, ∞);  add: X decreases, {X ≥ α} = (−∞, x].
    """
    log_alpha = indices * grid_step
    return _x_at_mixture_ratio(log_alpha if direction == "remove" else -log_alpha, q, sigma)


def _tent_split(grid_x, alphas, grid_step: float, sigma: float, pair):
    """P-masses sent to the lower and to the upper grid point by each interval α_i < X ≤ α_{i+1}.

    Each side is one combination c_a·A(J) + c_b·B(J) with non-negative value, computed directly
    (P(J) − α_i Q(J) and α_{i+1} Q(J) − P(J)) to avoid subtracting two rounded masses.
    """
    (p_a, p_b), (q_a, q_b) = pair
    lower, upper = np.minimum(grid_x[:-1], grid_x[1:]), np.maximum(grid_x[:-1], grid_x[1:])
    mass_a = _gaussian_interval_mass(lower, upper, 0.0, sigma)
    mass_b = _gaussian_interval_mass(lower, upper, 1.0, sigma)
    alpha_low, alpha_high = alphas[:-1], alphas[1:]
    excess_low = (p_a - alpha_low * q_a) * mass_a + (p_b - alpha_low * q_b) * mass_b
    excess_high = (alpha_high * q_a - p_a) * mass_a + (alpha_high * q_b - p_b) * mass_b
    # α_{i+1}/(α_{i+1} − α_i) = 1/(1 − e^{−h});  α_i/(α_{i+1} − α_i) = 1/(e^h − 1)
    to_upper = np.clip(excess_low, 0.0, None) / -math.expm1(-grid_step)
    to_lower = np.clip(excess_high, 0.0, None) / math.expm1(grid_step)
    return to_lower, to_upper


def _outer_masses(grid_x: np.ndarray, sigma: float, direction: str, pair):
    """P-mass with X above the top grid point, and with X below the lowest grid point."""
    (p_a, p_b), _ = pair
    x_low, x_high = grid_x[0], grid_x[-1]  # x at the lowest and at the highest α
    sign = 1.0 if direction == "remove" else -1.0  # remove: X > α_top ⟺ x > x_high
    above = p_a * special.ndtr(-sign * x_high / sigma) + p_b * special.ndtr(-sign * (x_high - 1) / sigma)
    below = p_a * special.ndtr(sign * x_low / sigma) + p_b * special.ndtr(sign * (x_low - 1) / sigma)
    return float(above), float(below)


def subsampled_gaussian_pld(
    sigma: float, q: float, grid_step: float, direction: str, tail_mass: float
) -> DiscretePLD:
    """Dominating grid PLD of one Poisson-subsampled Gaussian step (0 < q ≤ 1, σ > 0).

    The grid covers the losses of all but ``tail_mass`` of P on each side; the upper rest goes
    to +∞ and the lower rest to the lowest grid point (both pessimistic).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    low, high = loss_range(sigma, q, direction, tail_mass)
    indices = np.arange(math.floor(low / grid_step), math.ceil(high / grid_step) + 1, dtype=float)
    grid_x = _grid_x(indices, grid_step, q, sigma, direction)
    pair = _pair_coefficients(q, direction)
    to_lower, to_upper = _tent_split(grid_x, np.exp(indices * grid_step), grid_step, sigma, pair)
    pmf = np.zeros(indices.size)
    pmf[1:] += to_upper
    pmf[:-1] += to_lower
    above, below = _outer_masses(grid_x, sigma, direction, pair)
    pmf[0] += below
    return DiscretePLD(grid_step=grid_step, offset=int(indices[0]), pmf=pmf, infinity_mass=above)
