"""Privacy budget guard: refuse the step that would push ε above a maximum.

The guard runs before a step changes anything (it is a pre-step hook of the DPOptimizer).
It never touches the live accountant: prospective ε values are computed on a copy with
extra steps appended to its privacy history.

Computing ε can be expensive (PRV), so for a constant schedule ``(σ, q)`` the guard searches
once (exponential search, then bisection over ``k``) for the largest number ``k_safe`` of further
steps with ``ε(history + k·(σ, q)) ≤ (1 − SAFETY_MARGIN)·max_epsilon`` and allows those steps by
comparing step counters only.  Every step beyond ``k_safe`` is verified exactly: it is allowed
only if ``ε(history + 1 step)``, the ε the accountant will report after it, is ≤ ``max_epsilon``.

The fast path assumes that ε is non-decreasing in ``k`` up to a relative jitter below
``SAFETY_MARGIN``.  The true ε is monotone, but a numerical accountant need not be exactly: the
PRV accountant changes composition method at δ = T·10⁻¹⁴ and its ε can drop by ~10⁻⁴ relative
there.  Near the budget, where such a drop could hide a step above ``max_epsilon``, the exact
check decides.  The cache is recomputed whenever σ or q change or the accountant's history
changes in any other way (e.g. ``load_state_dict``).
"""

import copy
import math
from typing import Callable, List, Optional, Tuple

from opacus_dp.accountants.events import step_event
from opacus_dp.errors import PrivacyBudgetExceededError

MAX_SEARCHED_STEPS = 2**40  # beyond this the budget counts as unlimited for the schedule
SAFETY_MARGIN = 1e-3  # relative; steps with ε above (1 − margin)·max_epsilon are checked exactly

History = List[Tuple[float, float, int]]


def _normalized(history) -> History:
    """The steps that cost privacy, equal neighbours merged: free steps (``q = 0``, e.g. between
    the rounds of a correlated-noise mechanism) neither change ε nor break the cache."""
    merged: History = []
    for s, q, n in history:
        if float(q) == 0 or int(n) == 0:
            continue
        if merged and merged[-1][:2] == (float(s), float(q)):
            merged[-1] = (float(s), float(q), merged[-1][2] + int(n))
        else:
            merged.append((float(s), float(q), int(n)))
    return merged


def with_extra_steps(accountant, noise_multiplier: float, sample_rate: float, steps: int):
    """A copy of ``accountant`` whose history has ``steps`` more steps of ``(σ, q)``."""
    prospective = copy.deepcopy(accountant)
    if steps <= 0:
        return prospective
    history = prospective.history
    if history and tuple(history[-1][:2]) == (noise_multiplier, sample_rate):
        sigma, q, n = history[-1]
        history[-1] = (sigma, q, n + steps)
    else:
        history.append((noise_multiplier, sample_rate, steps))
    return prospective


def steps_added(base: History, now: History, noise_multiplier: float, sample_rate: float) -> Optional[int]:
    """How many ``(σ, q)`` steps turn ``base`` into ``now`` (None if ``now`` differs otherwise)."""
    key = (noise_multiplier, sample_rate)
    if len(now) < len(base) or now[: max(len(base) - 1, 0)] != base[: max(len(base) - 1, 0)]:
        return None
    extra, rest = 0, now[len(base):]
    if base:
        last, current = base[-1], now[len(base) - 1]
        if current[:2] != last[:2] or current[2] < last[2]:
            return None
        extra = current[2] - last[2]
        if extra and last[:2] != key:
            return None
    if len(rest) > 1 or (rest and rest[0][:2] != key):
        return None
    return extra + (rest[0][2] if rest else 0)


class BudgetGuard:
    """Pre-step check raising :class:`PrivacyBudgetExceededError` before ε > ``max_epsilon``.

    Args:
        accountant: the engine's accountant (read, never modified).
        max_epsilon: the budget ε_max (> 0).
        delta: the δ at which ε is measured.
        sample_rate: q of the coming steps (a number, or a callable returning it).
        epsilon_of: ``f(accountant) -> ε`` (default ``accountant.get_epsilon(delta)``).
    """

    def __init__(self, accountant, *, max_epsilon: float, delta: float, sample_rate,
                 epsilon_of: Optional[Callable] = None):
        if isinstance(max_epsilon, bool) or not isinstance(max_epsilon, (int, float)) \
                or not (max_epsilon > 0 and not math.isnan(max_epsilon)):
            raise ValueError(f"max_epsilon must be a number > 0, got {max_epsilon!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise ValueError(f"delta for max_epsilon must lie in (0, 1), got {delta!r}")
        self.accountant = accountant
        self.max_epsilon = float(max_epsilon)
        self.delta = float(delta)
        self._sample_rate = sample_rate
        self.epsilon_of = epsilon_of or (lambda acc: acc.get_epsilon(self.delta))
        self._cache = None  # (σ, q, base history, k_safe)
        self._exact_cache = None  # (σ, q, base history, k_max) of remaining_steps
        self.evaluations = 0  # number of ε computations, for cost tests

    def sample_rate(self) -> float:
        return float(self._sample_rate() if callable(self._sample_rate) else self._sample_rate)

    def __call__(self, optimizer) -> None:
        """Pre-step hook: raise if the coming step's event (:func:`~opacus_dp.accountants.events.step_event`,
        the one the accountant will record: σ, ``min(1, k·q)``) is one step too many."""
        event = step_event(optimizer, self.sample_rate())
        self.check(float(event.noise_multiplier), event.sample_rate)

    def check(self, noise_multiplier: float, sample_rate: float) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if one more ``(σ, q)`` step exceeds the budget.

        Fast path: the step is among the ``k_safe`` steps found well inside the budget.
        Otherwise the candidate is verified exactly: ε(history + this step) ≤ max_epsilon.
        A step of rate 0 (the free steps of a correlated-noise mechanism) costs nothing.
        """
        if sample_rate == 0:
            return
        if self._cached_steps("_cache", noise_multiplier, sample_rate, self._safe_steps) >= 1:
            return
        eps_next = self._epsilon_after(noise_multiplier, sample_rate, 1)
        if eps_next <= self.max_epsilon:
            return
        raise PrivacyBudgetExceededError(
            f"privacy budget exhausted: one more step (noise_multiplier={noise_multiplier}, "
            f"sample_rate={sample_rate}) would raise epsilon to {eps_next:.4g} > "
            f"max_epsilon={self.max_epsilon} at delta={self.delta} after "
            f"{len(self.accountant)} steps; the step was refused: no update, noise draw or accountant record was made, and "
            "this batch's clipped gradients were dropped (a retry needs a new backward pass)"
        )

    def remaining_steps(self, noise_multiplier: float, sample_rate: float) -> int:
        """Largest ``k`` with ε(history + k·(σ, q)) ≤ max_epsilon, found by search (cached).

        For an accountant whose ε is non-decreasing in ``k`` this is the number of further steps
        :meth:`check` allows."""
        return self._cached_steps("_exact_cache", noise_multiplier, sample_rate, self._max_steps)

    def _cached_steps(self, slot: str, noise_multiplier: float, sample_rate: float, search) -> int:
        """``search(σ, q)`` for the current history, minus the steps taken since it was cached."""
        now = _normalized(self.accountant.history)
        cache = getattr(self, slot)
        if cache is not None:
            sigma, q, base, k = cache
            if (sigma, q) == (noise_multiplier, sample_rate):
                done = steps_added(base, now, noise_multiplier, sample_rate)
                if done is not None:
                    return max(k - done, 0)
        k = search(noise_multiplier, sample_rate)
        setattr(self, slot, (noise_multiplier, sample_rate, now, k))
        return k

    def _epsilon_after(self, noise_multiplier, sample_rate, steps) -> float:
        self.evaluations += 1
        prospective = with_extra_steps(self.accountant, noise_multiplier, sample_rate, steps)
        return float(self.epsilon_of(prospective))

    def _safe_steps(self, noise_multiplier: float, sample_rate: float) -> int:
        """Largest ``k`` with ε(history + k steps) ≤ (1 − SAFETY_MARGIN)·max_epsilon (0 if none)."""
        limit = (1 - SAFETY_MARGIN) * self.max_epsilon
        return self._largest_fitting(noise_multiplier, sample_rate, limit, 0)

    def _max_steps(self, noise_multiplier: float, sample_rate: float) -> int:
        """Largest ``k`` with ε(history + k steps) ≤ max_epsilon (0 if none), searched upwards
        from the safe count."""
        start = self._cached_steps("_cache", noise_multiplier, sample_rate, self._safe_steps)
        return self._largest_fitting(noise_multiplier, sample_rate, self.max_epsilon, start)

    def _largest_fitting(self, noise_multiplier: float, sample_rate: float, limit: float, lo: int) -> int:
        """Largest ``k ≥ lo`` with ε(history + k steps) ≤ ``limit``, given that ``lo`` fits
        (``lo = 0`` always does): galloping search above ``lo``, then bisection."""
        def fits(steps: int) -> bool:
            return self._epsilon_after(noise_multiplier, sample_rate, steps) <= limit

        if lo >= MAX_SEARCHED_STEPS:
            return MAX_SEARCHED_STEPS
        width = 1
        while fits(lo + width):
            lo, width = lo + width, width * 2
            if lo + width > MAX_SEARCHED_STEPS:
                return MAX_SEARCHED_STEPS
        hi = lo + width
        while hi - lo > 1:  # invariant: lo fits, hi does not
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo
