"""Audit configurations shared by the sanity, tightness and detection tests.

``TIGHT``: full-batch DP-SGD with σ = 2.2 and T = 4 steps, i.e. a Gaussian mechanism with
μ = √T/σ ≈ 0.909 and ε ≈ 3.92 at δ = 1e-5 (PRV accountant; the exact GDP value agrees).
"""

TIGHT = dict(noise_multiplier=2.2, steps=4, canaries_per_run=1000, num_runs=4)
FULL_BATCH = dict(noise_multiplier=2.2, steps=4, canaries_per_run=500, num_runs=2)
POISSON = dict(noise_multiplier=1.5, steps=8, sample_rate=0.5, canaries_per_run=1000, num_runs=2)


def assert_never_above_the_accountant(report):
    """Every rigorous lower bound of the report is at most the accountant's ε."""
    eps = report.accountant_epsilon
    assert report.epsilon_lower_bound <= eps, report
    assert report.plain.epsilon_plain <= eps, report
    assert report.one_run.epsilon_lower_bound <= eps, report
    if report.config.sample_rate == 1.0:
        assert report.gdp.epsilon_gdp <= eps, report
        assert report.gaussian_epsilon <= eps * (1 + 1e-3), "the accountant under-reports the Gaussian ε"
