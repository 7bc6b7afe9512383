"""Sanity figure on DDP: two gloo processes, each rank with its own shard of the canary data.

The noise is drawn once (rank 0) and the clipped sums are all-reduced; every rank ends with the
same model, so every rank must report the same audit, with bounds below the accountant's ε.
"""

import pytest

from tests.audit.configurations import FULL_BATCH, POISSON, assert_never_above_the_accountant
from tests.audit.workers import audit_on_rank
from tests.distributed.spawn import run_on_ranks

JOBS = [
    ("dpddp", dict(FULL_BATCH, seed=21)),
    ("ddp", dict(POISSON, max_physical_batch_size=100, seed=22)),
]


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_lower_bounds_stay_below_the_accountant():
    per_rank = run_on_ranks(audit_on_rank, 2, JOBS, timeout=300)
    for rank_zero, rank_one in zip(*per_rank):
        assert rank_zero == rank_one  # same observations on both ranks: parameters in sync
        assert_never_above_the_accountant(rank_zero)
    full_batch, poisson = per_rank[0]
    assert full_batch.epsilon_lower_bound >= 0.5 * full_batch.accountant_epsilon
    assert poisson.epsilon_lower_bound >= 0.2 * poisson.accountant_epsilon
