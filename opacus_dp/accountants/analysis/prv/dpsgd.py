r"""ε of a DP-SGD run, i.e. of composed Poisson-subsampled Gaussian steps, from grid PLDs.

Under add/remove-one adjacency the same record is added (or removed) in every step, so the
run is dominated by the T-fold products of the per-step ``remove`` pairs and of the per-step
``add`` pairs; ε(δ) is the larger of the two (Zhu, Dong & Wang 2022).  Every approximation is
pessimistic (see ``subsampled_gaussian``, ``composition`` and ``tilted_composition``), so the
result is an upper bound on the true ε.  When the loss grid would need more than
``MAX_WINDOW_BINS`` bins (very large ε, or very small σ) the grid step is coarsened, which keeps
the bound valid but less tight.  Coarsening widens the composed window (each step's loss is
rounded on the coarser grid), so for extreme histories (about 10¹⁰ steps or more) no grid of step
≤ ``COARSEST_GRID_STEP`` fits; beyond ``MAX_TOTAL_STEPS`` steps the Chernoff window itself is
swamped by the round-off of ``T·log E[e^{λL}]``.  ε is then reported as ``inf`` (with a warning),
which is still an upper bound — never a finite under-estimate.
"""

import math
import warnings
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from opacus_dp.accountants.analysis.prv.composition import chernoff_window, compose, window_bins
from opacus_dp.accountants.analysis.prv.discrete_pld import epsilon_for_delta
from opacus_dp.accountants.analysis.prv.subsampled_gaussian import (
    DIRECTIONS,
    loss_range,
    subsampled_gaussian_pld,
)
from opacus_dp.accountants.analysis.prv.tilted_composition import compose_tilted

MAX_STEP_BINS = 1 << 20
MAX_WINDOW_BINS = 1 << 20
COARSEST_GRID_STEP = 10.0  # loss units; coarser grids hit exp overflow near the ±LOSS_CAP range
MAX_TOTAL_STEPS = 2**44  # T·2⁻⁵² ≤ 0.004: beyond, round-off of T·log E[e^{λL}] voids the window
_MAX_REFINEMENTS = 6
_ROUNDOFF_TOLERANCE = 1e-4
_PLAIN_DELTA_PER_STEP = 1e-14  # below δ = T·1e-14 the plain FFT power is not trusted

Segment = Tuple[float, float, int]  # (noise_multiplier σ, sample_rate q, steps)


def _widest_step_range(segments: Sequence[Segment], tail_mass: float) -> float:
    widths = []
    for sigma, q, _ in segments:
        for direction in DIRECTIONS:
            low, high = loss_range(sigma, q, direction, tail_mass)
            widths.append(high - low)
    return max(widths)


def _step_plds(segments: Sequence[Segment], grid_step: float, direction: str, tail_mass: float):
    return [(subsampled_gaussian_pld(sigma, q, grid_step, direction, tail_mass), steps) for sigma, q, steps in segments]


def _plds_on_fitting_grid(segments: Sequence[Segment], grid_step: float, window_tail: float, step_tail: float):
    """Per direction: (list of (step PLD, steps), composed loss window) on the finest grid
    (≥ ``grid_step``) whose window fits in ``MAX_WINDOW_BINS`` bins; ``None`` when no grid of
    step ≤ ``COARSEST_GRID_STEP`` fits within ``_MAX_REFINEMENTS`` coarsenings."""
    grid_step = max(grid_step, _widest_step_range(segments, step_tail) / MAX_STEP_BINS)
    for _ in range(_MAX_REFINEMENTS):
        if grid_step > COARSEST_GRID_STEP:
            return None
        per_direction = []
        for direction in DIRECTIONS:
            plds = _step_plds(segments, grid_step, direction, step_tail)
            per_direction.append((plds, chernoff_window(plds, window_tail)))
        if any(window[0] > window[1] for _, window in per_direction):
            return None  # Chernoff bounds swamped by round-off of T·log E[e^{λL}]
        bins = max(window_bins(window, grid_step) for _, window in per_direction)
        if bins <= MAX_WINDOW_BINS:
            return per_direction
        grid_step *= 1.05 * bins / MAX_WINDOW_BINS
    return None


def active_segments(history: Sequence[Segment]) -> List[Segment]:
    """The segments that cost privacy (q > 0 and at least one step), those of equal ``(σ, q)``
    merged (composition commutes; a history alternating with free ``q = 0`` steps, as the
    correlated-noise mechanisms record, is composed once per distinct event)."""
    merged: Dict[Tuple[float, float], int] = {}
    for s, q, n in history:
        if q > 0 and n > 0:
            merged[(float(s), float(q))] = merged.get((float(s), float(q)), 0) + int(n)
    return [(s, q, n) for (s, q), n in merged.items()]


def compute_epsilon(history: Sequence[Segment], delta: float, grid_step: float, tail_mass: float) -> float:
    """Upper bound on ε(δ) of the composition of all ``(σ, q, steps)`` segments.

    ``tail_mass`` bounds the probability mass dropped by truncation (it is charged to δ as
    mass at +∞, so the bound stays valid for the requested δ).
    """
    segments = active_segments(history)
    if not segments:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in segments):
        return math.inf
    total_steps = sum(steps for _, _, steps in segments)
    if total_steps > MAX_TOTAL_STEPS:
        return _unresolvable(total_steps)
    step_tail = tail_mass / (4 * total_steps)
    per_direction = _plds_on_fitting_grid(segments, grid_step, tail_mass / 4, step_tail)
    if per_direction is None:
        return _unresolvable(total_steps)
    return max(_direction_epsilon(plds, window, delta, tail_mass / 4) for plds, window in per_direction)


def _unresolvable(total_steps: int) -> float:
    """ε = ∞ (a valid upper bound) for a history the grid cannot resolve, with a warning."""
    warnings.warn(
        f"the prv accountant cannot resolve this history ({total_steps} steps): its privacy loss "
        "does not fit on a loss grid in double precision, so epsilon is reported as inf (a valid "
        "but uninformative upper bound); accountant='rdp' gives a finite bound for very long runs",
        RuntimeWarning, stacklevel=4,
    )
    return math.inf


def _direction_epsilon(plds, window, delta: float, tail_mass: float) -> float:
    """ε of one direction.  The plain FFT composition is used unless δ is below the reach of
    its round-off (about T·2⁻⁵² relative to the bulk, see ``tilted_composition``) or its
    round-off allowance visibly inflates ε; then the tilted composition is used."""
    plain = compose(plds, tail_mass, window)
    epsilon = epsilon_for_delta(plain, delta)
    total_steps = sum(count for _, count in plds)
    inflated = epsilon > epsilon_for_delta(replace(plain, roundoff=0.0), delta) * (1 + _ROUNDOFF_TOLERANCE) + 1e-12
    if delta >= total_steps * _PLAIN_DELTA_PER_STEP and not inflated:
        return epsilon
    tilted = compose_tilted(plds, tail_mass, delta, MAX_WINDOW_BINS)
    return epsilon if tilted is None else epsilon_for_delta(tilted, delta)
