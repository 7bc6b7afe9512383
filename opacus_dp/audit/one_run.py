"""One-run auditing: Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run".

Setting: ``m`` canaries, each included in the training data independently with probability
1/2. After training, the auditor guesses "in" for the ``k₊`` canaries with the highest scores,
"out" for the ``k₋`` lowest, and abstains on the rest (``r = k₊ + k₋`` guesses). If training is
(ε, δ)-DP with respect to each canary, the number ``W`` of correct guesses satisfies, for all v,

    P[W ≥ v] ≤ P[Bin(r, p_ε) ≥ v] + 2mδ · max_{1 ≤ i ≤ v} P[v − i ≤ Bin(r, p_ε) < v] / i,

with ``p_ε = e^ε / (1 + e^ε)`` (the paper's Thm. 3.1 and its δ > 0 extension, evaluated as in its
Appendix D). The right-hand side is a p-value for the hypothesis "(ε, δ)-DP"; the largest ε
it rejects at level α is a lower bound on ε with confidence 1 − α. The canaries need not be
independent of each other: the analysis covers any training algorithm, in a single run.
Several guess counts may be tried; the level is then split among them (Bonferroni).
"""

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
from scipy import special, stats

from opacus_dp.audit.statistics import check_confidence, check_delta

DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5)
_BISECTION_STEPS = 40


def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise ValueError(
            "need 0 ≤ num_correct ≤ num_guesses ≤ num_canaries, got "
            f"num_correct={num_correct}, num_guesses={num_guesses}, num_canaries={num_canaries}"
        )


def one_run_p_value(*, num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float) -> float:
    """Upper bound on ``P[W ≥ num_correct]`` under (ε, δ)-DP (see module doc)."""
    _check_counts(num_canaries, num_guesses, num_correct)
    r, v = num_guesses, num_correct
    p_correct = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p_correct))
    if delta == 0.0 or v == 0:
        return min(1.0, tail)
    below_v = stats.binom.cdf(v - 1, r, p_correct)
    shifts = np.arange(1, v + 1)
    window = below_v - stats.binom.cdf(v - 1 - shifts, r, p_correct)  # P[v−i ≤ W < v]
    spread = float(np.max(window / shifts))
    return min(1.0, tail + 2.0 * num_canaries * delta * spread)


def one_run_epsilon_lower_bound(*, num_canaries: int, num_guesses: int, num_correct: int,
                                delta: float, alpha: float) -> float:
    """Largest ε whose p-value is below ``alpha`` (bisection; 0 if even ε = 0 is not rejected)."""
    delta = check_delta(delta)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")

    def rejected(eps: float) -> bool:
        return one_run_p_value(num_canaries=num_canaries, num_guesses=num_guesses,
                               num_correct=num_correct, epsilon=eps, delta=delta) < alpha

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2.0 * high
        if high > 1e3:
            return math.inf
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def count_correct_guesses(scores: np.ndarray, membership: np.ndarray, num_guesses: int) -> int:
    """Correct guesses when the top ``⌈r/2⌉`` scores are guessed "in" and the bottom ``⌊r/2⌋`` "out".

    Ties are broken by canary index, never by membership.
    """
    order = np.argsort(np.asarray(scores, dtype=float), kind="stable")
    membership = np.asarray(membership, dtype=bool)
    guessed_in, guessed_out = (num_guesses + 1) // 2, num_guesses // 2
    top = order[len(order) - guessed_in:] if guessed_in else order[:0]
    return int(membership[top].sum() + (~membership[order[:guessed_out]]).sum())


@dataclass(frozen=True)
class OneRunBound:
    """Result of :func:`one_run_audit`: the bound and the guess count that achieved it."""

    epsilon_lower_bound: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    confidence: float


def _guess_counts(num_canaries: int, guess_fractions: Sequence[float]) -> Tuple[int, ...]:
    if not guess_fractions or any(not 0 < f <= 1 for f in guess_fractions):
        raise ValueError(f"guess_fractions must be fractions in (0, 1], got {tuple(guess_fractions)!r}")
    return tuple(sorted({max(1, min(num_canaries, round(f * num_canaries))) for f in guess_fractions}))


def one_run_audit(scores, membership, *, delta: float, confidence: float = 0.95,
                  guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> OneRunBound:
    """Best one-run bound over the guess counts ``f·m``.

    Each count is tested at level ``α / (number of counts)``, so the best holds with ≥ ``confidence``.
    """
    scores, membership = np.asarray(scores, dtype=float), np.asarray(membership, dtype=bool)
    if scores.shape != membership.shape or scores.ndim != 1 or scores.size == 0:
        raise ValueError("scores and membership must be 1-d arrays of the same, non-zero length")
    counts = _guess_counts(scores.size, guess_fractions)
    alpha = (1.0 - check_confidence(confidence)) / len(counts)
    results = []
    for r in counts:
        v = count_correct_guesses(scores, membership, r)
        eps = one_run_epsilon_lower_bound(num_canaries=scores.size, num_guesses=r, num_correct=v,
                                          delta=delta, alpha=alpha)
        results.append(OneRunBound(eps, scores.size, r, v, confidence))
    return max(results, key=lambda result: result.epsilon_lower_bound)
