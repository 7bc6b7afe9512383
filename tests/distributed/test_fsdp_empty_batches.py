"""FSDP2 with empty local batches on one rank: every rank runs the same collectives (2 gloo processes).

The job must finish well within the harness's timeout (a rank left in a collective the other
never enters would hang it); σ = 0 must equal one process replaying the concatenated batches
with per-sample gradients from a batch-size-1 autograd loop, clipped by hand.
"""

import pytest
import torch

from tests.distributed.oracle import replay_on_one_process
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers_fsdp import FLAT_C, LR, make_model
from tests.distributed.workers_fsdp_empty import LOOPS, MODES, empty_batches_job

pytestmark = pytest.mark.distributed
WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(empty_batches_job, WORLD, timeout=60)


def replay(reports):
    """One process, the ranks' pieces of each step concatenated (empty ones included), SGD."""
    return replay_on_one_process(make_model(seed=0), reports, FLAT_C, LR)


def _local_sizes(report):
    return [sum(len(x) for x, _ in step) for step in report["batches"]]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_local_batch_on_one_rank_takes_part_in_the_step(ranks, mode, loop):
    reports = [r[(mode, loop)] for r in ranks]
    sizes = [_local_sizes(r) for r in reports]
    assert reports[0]["steps"] == reports[1]["steps"] == len(sizes[0]) == 6
    one_empty = [s for s in range(6) if (sizes[0][s] == 0) != (sizes[1][s] == 0)]
    assert one_empty, sizes  # the case under test occurs
    expected = replay(reports)
    for report in reports:
        for got, want in zip(report["final"], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(reports[0]["final"][0], reports[0]["start"][0])
