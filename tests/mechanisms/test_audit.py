"""The white-box audit of the correlated mechanisms: honest runs stay below the accountant's ε,
a sensitivity computed for the wrong number of bands (Δ of b = 1, the engine still claims b = 16)
is flagged.

Banded with b = 16 groups taken whole (q = 1/16, group rate 1), 48 steps = 3 rounds, σ = 1.5:
the claim is a Gaussian mechanism with μ = √3/σ ≈ 1.15 (ε ≈ 5.2 at δ = 1e-5). With Δ = 1 instead
of ‖c‖ ≈ 1.43 the noise is 1.43 times too small.
"""

import dataclasses

import numpy as np
import pytest
import torch

from opacus_dp.audit import AuditConfig, run_audit
from opacus_dp.audit.correlated import MechanismRecord, canary_groups, correlated_scores
from opacus_dp.mechanisms import engine as mechanism_engine
from opacus_dp.mechanisms import toeplitz
from opacus_dp.mechanisms.strategies import make_strategy
from tests.audit.configurations import assert_never_above_the_accountant

BANDED = dict(noise_multiplier=1.5, steps=48, sample_rate=1 / 16, canaries_per_run=1000, num_runs=2, seed=7,
              noise_mechanism="banded", bands=16)


def test_canary_groups_follow_the_indices_of_present_canaries():
    assignment = torch.tensor([5, 6, 7, 8])
    membership = torch.tensor([True, False, True, True])
    assert canary_groups(membership, assignment).tolist() == [5, 6, 6, 7]


def test_scores_are_the_gaussian_likelihood_ratio_for_whole_groups():
    strategy = make_strategy("banded", steps=8, bands=2)
    record = MechanismRecord(strategy, groups=2, group_rate=1.0)
    torch.manual_seed(0)
    x = torch.randn(8, 3, dtype=torch.float64)
    scores = correlated_scores(x, torch.tensor([0, 1, 1]), record=record, noise_multiplier=0.7)
    C = toeplitz.dense(strategy.column(8), 8)
    u = C @ torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0], dtype=torch.float64)
    variance = (0.7 * strategy.sensitivity) ** 2
    expected = float(((C @ x[:, 0]) @ u - u @ u / 2) / variance)
    assert scores[0] == pytest.approx(expected)


@pytest.mark.slow
def test_honest_banded_stays_below_and_wrong_bands_sensitivity_is_flagged(monkeypatch):
    honest = run_audit(AuditConfig(**BANDED))
    assert honest.headline_method == "gdp"
    assert_never_above_the_accountant(honest)
    assert honest.gdp.epsilon_gdp <= honest.accountant_epsilon
    real = mechanism_engine.make_strategy
    monkeypatch.setattr(mechanism_engine, "make_strategy",
                        lambda *args, **kwargs: dataclasses.replace(real(*args, **kwargs), sensitivity=1.0))
    broken = run_audit(AuditConfig(**BANDED))
    assert broken.accountant_epsilon == honest.accountant_epsilon  # the claim is unchanged
    assert broken.violates_claim, broken
    assert np.isfinite(broken.epsilon_lower_bound)


def test_the_audit_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="noise_mechanism"):
        AuditConfig(noise_multiplier=1.0, steps=4, noise_mechanism="tree")
    with pytest.raises(ValueError, match="api='modern'"):
        AuditConfig(noise_multiplier=1.0, steps=4, noise_mechanism="banded", bands=2, api="classic",
                    accountant="rdp")


@pytest.mark.parametrize("mechanism,bands,sample_rate", [("banded", 2, 0.25), ("blt", None, 0.25)])
def test_honest_amplified_banded_and_blt_stay_below_the_accountant(mechanism, bands, sample_rate):
    config = AuditConfig(noise_multiplier=1.2, steps=12, sample_rate=sample_rate, canaries_per_run=600,
                         seed=3, noise_mechanism=mechanism, bands=bands)
    report = run_audit(config)
    assert report.headline_method == ("plain" if mechanism == "banded" else "gdp")
    assert_never_above_the_accountant(report)
    assert report.gdp.epsilon_gdp <= report.accountant_epsilon
