"""Tightness figure: white-box Dirac canaries, full batch, theoretical ε between 2 and 4.

σ = 2.2, T = 4, q = 1: the mechanism is μ-GDP with μ = √4/2.2 ≈ 0.909, ε ≈ 3.92 at δ = 1e-5.
4 runs × 1000 canaries through the real engine must certify ≥ 70 % of it at 95 % confidence.
"""

import pytest

from opacus_dp.audit import AuditConfig, run_audit
from tests.audit.configurations import TIGHT, assert_never_above_the_accountant


@pytest.mark.slow
def test_gdp_bound_reaches_seventy_percent_of_the_accountant():
    report = run_audit(AuditConfig(**TIGHT, seed=31))
    assert 2.0 <= report.accountant_epsilon <= 4.0
    assert report.config.confidence == 0.95 and report.headline_method == "gdp"
    assert report.gaussian_epsilon == pytest.approx(report.accountant_epsilon, rel=1e-2)
    assert_never_above_the_accountant(report)
    assert report.epsilon_lower_bound >= 0.7 * report.accountant_epsilon, report
