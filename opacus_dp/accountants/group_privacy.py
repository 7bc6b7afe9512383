"""User-level ε of example-level DP-SGD by group privacy.

**The lemma.** Let M be (ε, δ)-DP for datasets that differ in one record (one added or removed),
and let D, D' differ in k records. A chain D = D₀, D₁, …, D_k = D' changes one record per link, so
for every event S, by induction on k,

    P[M(D₀) ∈ S] ≤ e^ε P[M(D₁) ∈ S] + δ
                 ≤ e^ε (e^{(k−1)ε} P[M(D_k) ∈ S] + δ Σ_{i<k−1} e^{iε}) + δ
                 = e^{kε} P[M(D_k) ∈ S] + δ Σ_{i=0}^{k−1} e^{iε}.

So M is (k·ε, δ_k)-DP for groups of k records with δ_k = δ Σ_{i=0}^{k−1} e^{iε} ≤ k e^{(k−1)ε} δ.
For δ = 0 this is the group privacy of pure DP (Dwork & Roth 2014, "The Algorithmic Foundations
of Differential Privacy", Theorem 2.2); Vadhan 2017 ("The Complexity of Differential Privacy",
Lemma 2.2) states the (ε, δ) case with a looser δ factor. The sum is what the chain gives.

**Users.** If every user contributes at most k examples, removing or adding a user changes at most
k records, so an example-level (ε', δ')-DP run is (k ε', δ' Σ_{i<k} e^{iε'})-DP per user. An
accountant gives a whole curve ε(δ'); :func:`user_level_epsilon` picks the δ' that minimises
k ε(δ') subject to δ' Σ_{i<k} e^{iε(δ')} ≤ δ_user.
"""

import math
import numbers
from typing import Callable, Optional, Tuple

from opacus_dp.accountants.validation import as_real, check_delta

PRIVACY_UNITS = ("example", "user")
LOG_DELTA_FLOOR = math.log(1e-300)  # smallest example-level δ' the search asks an accountant about
_MAX_PROBES = 200
_LOG_MARGIN = 1e-12  # feasible means δ' S ≤ δ_user (1 − 10⁻¹²): rounding of e^x cannot break the bound


def check_group_size(group_size, name: str = "max_examples_per_user") -> int:
    """k must be an integer ≥ 1 (bool and floats refused)."""
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 1 (the most examples one user contributes), "
                        f"got {group_size!r}")
    if group_size < 1:
        raise ValueError(f"{name} must be >= 1 (the most examples one user contributes), got {group_size!r}")
    return int(group_size)


def log_group_factor(epsilon: float, group_size: int) -> float:
    """log Σ_{i=0}^{k−1} e^{iε} = (k−1)ε + log((1 − e^{−kε}) / (1 − e^{−ε})), without overflow
    (log k at ε = 0; ∞ at ε = ∞)."""
    if epsilon == 0.0:
        return math.log(group_size)
    if math.isinf(epsilon):
        return math.inf if group_size > 1 else 0.0
    return (group_size - 1) * epsilon + math.log(-math.expm1(-group_size * epsilon)) - math.log(-math.expm1(-epsilon))


def group_privacy(epsilon: float, delta: float, group_size: int) -> Tuple[float, float]:
    """``(k ε, δ Σ_{i=0}^{k−1} e^{iε})``: the guarantee of an (ε, δ)-DP mechanism for datasets that
    differ in k records (module docstring). δ_k may exceed 1 (then the bound says nothing) or be ∞."""
    epsilon = as_real(epsilon, "epsilon")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    delta = as_real(delta, "delta")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must lie in [0, 1], got {delta!r}")
    k = check_group_size(group_size, "group_size")
    if delta == 0.0:
        return k * epsilon, 0.0
    log_delta_k = math.log(delta) + log_group_factor(epsilon, k)
    return k * epsilon, (math.exp(log_delta_k) if log_delta_k < 709.0 else math.inf)


class _Probes:
    """Evaluates ε at δ' = e^x, tells whether δ' Σ_{i<k} e^{iε(δ')} ≤ δ_user, keeps the best feasible point."""

    def __init__(self, epsilon_at: Callable[[float], float], delta_user: float, group_size: int):
        self.epsilon_at, self.log_delta_user, self.group_size = epsilon_at, math.log(delta_user), group_size
        self.best: Tuple[float, float] = (math.inf, 0.0)  # (ε_user, δ'): vacuous until a point is feasible

    def excess(self, log_delta: float) -> float:
        """log(δ' Σ e^{iε(δ')}) − log δ_user + margin: ≤ 0 exactly when δ' = e^x is feasible."""
        delta = math.exp(log_delta)
        epsilon = float(self.epsilon_at(delta))
        if math.isnan(epsilon) or epsilon < 0:
            raise ValueError(f"epsilon_at({delta!r}) returned {epsilon!r}: it must return an epsilon >= 0")
        value = log_delta + log_group_factor(epsilon, self.group_size) - self.log_delta_user + _LOG_MARGIN
        if value <= 0 and (self.group_size * epsilon, -delta) < (self.best[0], -self.best[1]):
            self.best = (self.group_size * epsilon, delta)  # smallest ε_user; on a tie, the larger δ'
        return value


def user_level_epsilon(epsilon_at: Callable[[float], float], delta_user: float, max_examples_per_user: int,
                       *, log_delta_tolerance: float = 1e-6) -> Tuple[float, float]:
    """``(ε_user, δ')``: the run is (ε_user, δ_user)-DP per user with at most k examples, as
    ε_user = k·ε(δ') with δ' Σ_{i<k} e^{iε(δ')} ≤ δ_user (group privacy, module docstring).

    ``epsilon_at(δ')`` is the example-level ε at δ' (e.g. ``accountant.get_epsilon``), decreasing
    in δ'. Every feasible δ' satisfies δ' ≤ δ_user / k; the search brackets the largest feasible δ'
    on log δ' (down to 10⁻³⁰⁰) and narrows the bracket to ``log_delta_tolerance`` by safeguarded
    false position, then returns the feasible point with the smallest ε_user it evaluated —
    never an infeasible one. k = 1 returns ``(epsilon_at(δ_user), δ_user)``. ``(∞, 0)`` when no
    δ' certifies a finite ε_user.
    """
    delta_user = check_delta(delta_user, "delta_user")
    k = check_group_size(max_examples_per_user)
    if not as_real(log_delta_tolerance, "log_delta_tolerance") > 0:
        raise ValueError(f"log_delta_tolerance must be > 0 (a width in log δ'), got {log_delta_tolerance!r}")
    if k == 1:
        return float(epsilon_at(delta_user)), delta_user
    probes = _Probes(epsilon_at, delta_user, k)
    high = math.log(delta_user) - math.log(k)  # S ≥ k: no larger δ' is feasible
    excess_high = probes.excess(high)
    if excess_high <= 0:  # ε(δ_user / k) = 0
        return probes.best
    bracket = _feasible_below(probes, high, excess_high)
    if bracket is not None:
        _narrow(probes, *bracket, log_delta_tolerance)
    return probes.best


def _feasible_below(probes: _Probes, high: float, excess_high: float) -> Optional[Tuple[float, float, float, float]]:
    """``(low, excess(low), high, excess(high))`` with low feasible and high not, or None when no
    point above the floor is found feasible. The excess h(x) = x + log S(ε(e^x)) − log δ_user has
    slope ≤ 1 (ε falls as δ' grows), so a step down by h(x) never passes the boundary; where h is
    flat the step is lengthened to h(x) / slope (slope from the last two points, clipped to
    [1/4, 1]); every step is at least one unit of log δ'."""
    slope = 1.0
    for _ in range(_MAX_PROBES):
        if high <= LOG_DELTA_FLOOR:
            return None
        low = max(high - max(excess_high / slope, 1.0), LOG_DELTA_FLOOR)
        excess_low = probes.excess(low)
        if excess_low <= 0:
            return low, excess_low, high, excess_high
        change = (excess_high - excess_low) / (high - low)
        slope = min(1.0, max(0.25, change)) if math.isfinite(change) else 1.0
        high, excess_high = low, excess_low
    return None


def _narrow(probes: _Probes, low: float, f_low: float, high: float, f_high: float, tolerance: float) -> None:
    """Shrink [low, high] (excess ≤ 0 at low, > 0 at high) to width ``tolerance`` or until a point
    lies on the boundary: false position, bisection after a step that did not halve the bracket."""
    interpolate = True
    for _ in range(_MAX_PROBES):
        width = high - low
        if width <= tolerance:
            return
        point = (low + high) / 2
        if interpolate and f_high > f_low:
            candidate = high - f_high * width / (f_high - f_low)
            if low < candidate < high:
                point = candidate
        value = probes.excess(point)
        if -1e-12 <= value <= 0:  # on the boundary up to round-off
            return
        if value <= 0:
            low, f_low = point, value
        else:
            high, f_high = point, value
        interpolate = high - low <= width / 2


def epsilon_for_privacy_unit(epsilon_at: Callable[[float], float], delta: float, privacy_unit: str = "example",
                             max_examples_per_user: Optional[int] = None) -> float:
    """ε at ``delta`` per example (``epsilon_at(delta)``), or per user with at most
    ``max_examples_per_user`` examples (:func:`user_level_epsilon`)."""
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    if privacy_unit == "example":
        if max_examples_per_user is not None:
            raise ValueError("max_examples_per_user applies only to privacy_unit='user'; drop it, or pass "
                             "privacy_unit='user' for the per-user epsilon")
        return epsilon_at(delta)
    if max_examples_per_user is None:
        raise ValueError("privacy_unit='user' needs max_examples_per_user=k, the most examples one user contributes")
    return user_level_epsilon(epsilon_at, check_delta(delta, "delta"), max_examples_per_user)[0]
