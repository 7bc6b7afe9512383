"""One-run bound (Steinke, Nasr & Jagielski 2023): p-value, ε search, guesses and coverage."""

import math

import numpy as np
import pytest
from scipy import special, stats

from opacus_dp.audit.one_run import (
    count_correct_guesses,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)


@pytest.mark.parametrize("r,v,eps", [(10, 9, 1.0), (100, 70, 0.5), (300, 280, 2.5), (5, 0, 1.0)])
def test_pure_dp_p_value_is_the_binomial_test(r, v, eps):
    oracle = stats.binomtest(v, r, special.expit(eps), alternative="greater").pvalue
    got = one_run_p_value(num_canaries=1000, num_guesses=r, num_correct=v, epsilon=eps, delta=0.0)
    assert got == pytest.approx(oracle, rel=1e-9)


def test_delta_term_by_hand():
    # r = 2, v = 2: P[W ≥ 2] + 2mδ · max(P[W = 1]/1, P[W ∈ {0, 1}]/2)
    p = special.expit(0.8)
    pmf = [(1 - p) ** 2, 2 * p * (1 - p), p ** 2]
    m, delta = 50, 1e-3
    expected = pmf[2] + 2 * m * delta * max(pmf[1], (pmf[0] + pmf[1]) / 2)
    got = one_run_p_value(num_canaries=m, num_guesses=2, num_correct=2, epsilon=0.8, delta=delta)
    assert got == pytest.approx(expected, rel=1e-12)


def test_bound_is_the_boundary_of_rejection():
    kwargs = dict(num_canaries=1000, num_guesses=200, num_correct=180, delta=1e-5)
    eps = one_run_epsilon_lower_bound(alpha=0.05, **kwargs)
    assert 1.0 < eps < 3.0
    assert one_run_p_value(epsilon=eps, **kwargs) < 0.05
    assert one_run_p_value(epsilon=eps + 1e-6, **kwargs) >= 0.05


def test_no_evidence_gives_zero():
    assert one_run_epsilon_lower_bound(num_canaries=100, num_guesses=20, num_correct=10,
                                       delta=1e-5, alpha=0.05) == 0.0


def test_counts_are_checked():
    with pytest.raises(ValueError, match="num_correct"):
        one_run_p_value(num_canaries=10, num_guesses=5, num_correct=6, epsilon=1.0, delta=0.0)


def test_guesses_take_top_as_in_and_bottom_as_out():
    scores = np.array([0.1, 5.0, -3.0, 2.0, -1.0, 0.0])
    member = np.array([True, True, False, False, True, False])
    # r = 4: "in" for scores 5.0, 2.0 (1 right), "out" for -3.0, -1.0 (1 right)
    assert count_correct_guesses(scores, member, 4) == 2
    # r = 3: "in" for 5.0 and 2.0, "out" for -3.0
    assert count_correct_guesses(scores, member, 3) == 2
    assert count_correct_guesses(scores, member, 1) == 1


def _randomized_response_audit(eps0, m, rng):
    """Each canary's score reveals its membership through ε0-randomized response plus tie noise."""
    member = rng.random(m) < 0.5
    truthful = rng.random(m) < special.expit(eps0)
    reported = np.where(truthful, member, ~member)
    scores = reported + 0.01 * rng.random(m)
    return one_run_audit(scores, member, delta=0.0, confidence=0.95)


def test_bound_covers_an_exactly_eps_dp_mechanism():
    rng = np.random.default_rng(3)
    eps0 = 1.0
    bounds = np.array([_randomized_response_audit(eps0, 2000, rng).epsilon_lower_bound for _ in range(100)])
    assert np.mean(bounds > eps0) <= 0.05
    assert np.median(bounds) > 0.6 * eps0  # and the audit is not vacuous


def test_audit_reports_the_winning_guess_count():
    rng = np.random.default_rng(4)
    result = _randomized_response_audit(3.0, 1000, rng)
    assert result.num_canaries == 1000 and result.confidence == 0.95
    assert result.num_guesses in (20, 50, 100, 200, 500)
    # recomputing at the reported count with the Bonferroni level gives the same bound
    again = one_run_epsilon_lower_bound(num_canaries=1000, num_guesses=result.num_guesses,
                                        num_correct=result.num_correct, delta=0.0, alpha=0.05 / 5)
    assert again == pytest.approx(result.epsilon_lower_bound)
    assert not math.isnan(result.epsilon_lower_bound)
