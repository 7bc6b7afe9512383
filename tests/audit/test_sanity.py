"""Sanity figure: on every engine path the empirical lower bound stays below the accountant's ε.

Each configuration is an independent audit (own seed) through the real engine. For full-batch
runs the audit must also have power (bound ≥ half the accountant's ε), so that "below" means
something; for Poisson runs the (ε, δ) and one-run bounds are weaker but still rigorous.
"""

import pytest

from opacus_dp.audit import AuditConfig, run_audit
from tests.audit.configurations import FULL_BATCH, POISSON, assert_never_above_the_accountant
from tests.distributed.cpu_data_parallel import CPUDataParallel


def _data_parallel(model):
    return CPUDataParallel(model, num_replicas=2)


CASES = {
    "hooks, full batch": (dict(FULL_BATCH, seed=1), None),
    "hooks, Poisson": (dict(POISSON, seed=2), None),
    "classic API, virtual steps, full batch": (
        dict(FULL_BATCH, api="classic", accountant="rdp", max_physical_batch_size=64, seed=3), None),
    "virtual steps, Poisson": (dict(POISSON, max_physical_batch_size=50, seed=4), None),
    "ghost, full batch": (dict(FULL_BATCH, grad_sample_mode="ghost", seed=5), None),
    "bk, Poisson": (dict(POISSON, grad_sample_mode="bk", seed=6), None),
    "functorch, full batch": (dict(FULL_BATCH, grad_sample_mode="functorch", seed=7), None),
    "DataParallel, full batch": (dict(FULL_BATCH, seed=8), _data_parallel),
    "DataParallel, classic API, Poisson": (
        dict(POISSON, api="classic", accountant="rdp", seed=9), _data_parallel),
    "sum reduction, RDP accountant, Poisson": (
        dict(POISSON, loss_reduction="sum", accountant="rdp", seed=10), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lower_bound_never_exceeds_the_accountant(case):
    arguments, wrapper = CASES[case]
    report = run_audit(AuditConfig(**arguments), model_wrapper=wrapper)
    assert_never_above_the_accountant(report)
    if report.config.sample_rate == 1.0:
        assert report.epsilon_lower_bound >= 0.5 * report.accountant_epsilon, report
    else:
        assert report.epsilon_lower_bound >= 0.2 * report.accountant_epsilon, report
