"""Ranks that leave the common sequence of collectives outside the optimizer (2 gloo processes).

FSDP2: every forward and backward pass is a collective, so a rank that skips a batch, stops
before its forward pass or exits must make every rank fail fast with an error that names it
(never a hang until the process group's timeout, never a silent pairing of different batches).
DDP/DPDDP: a rank that skips a batch is refused at the next step on every rank.
"""

import pytest
import torch

from tests.distributed.spawn import COLLECTIVE_TIMEOUT_S, run_on_ranks
from tests.distributed.workers_out_of_step import (STEP_TIMEOUT, ddp_skip_job, fsdp_rank_exits, fsdp_rank_stays_away,
                                                  fsdp_skip_job)

pytestmark = pytest.mark.distributed
WORLD = 2
BOUND_S = STEP_TIMEOUT + 1.0 + 3.0  # step timeout + the search for missing ranks + slack


@pytest.fixture(scope="module")
def fsdp_skips():
    return run_on_ranks(fsdp_skip_job, WORLD, timeout=60)


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_a_rank_that_skips_a_batch_under_fsdp2_is_refused_on_every_rank(fsdp_skips, where):
    reports = [r[where] for r in fsdp_skips]
    for rank, report in enumerate(reports):
        assert report["type"] == "RanksOutOfStepError", (rank, report)
        assert "StepRefusedError" in report["classes"]
        assert report["refusals"] == {1: 7}, report  # rank 1 skipped: it is the one named
        assert "rank 1" in report["message"] and "rank 0" in report["message"]
        assert report["elapsed"] < BOUND_S
        assert report["step"] in (1, 2)  # the first mispaired collective, not later


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_that_stays_away_is_named_within_the_step_timeout(fsdp_skips, where):
    report = fsdp_skips[0]["stays_away"] if where == "forward" else \
        run_on_ranks(fsdp_rank_stays_away, WORLD, "backward", timeout=60)[0]
    assert report["type"] == "StepCollectiveError", report
    assert report["missing"] == [1]
    assert "rank 1 did not join" in report["message"]
    assert report["elapsed"] < BOUND_S < COLLECTIVE_TIMEOUT_S


def test_a_rank_that_exits_is_named_not_reported_as_a_closed_connection():
    report = run_on_ranks(fsdp_rank_exits, WORLD, timeout=60)[0]
    assert report["type"] == "StepCollectiveError", report
    assert report["missing"] == [1]
    assert report["elapsed"] < BOUND_S


@pytest.fixture(scope="module")
def ddp_skips():
    return run_on_ranks(ddp_skip_job, WORLD, timeout=60)


@pytest.mark.parametrize("wrapper", ["dpddp", "ddp"])
def test_a_rank_that_skips_a_batch_under_ddp_is_refused_at_the_next_step_everywhere(ddp_skips, wrapper):
    reports = [r[wrapper] for r in ddp_skips]
    for report in reports:
        assert len(report["errors"]) == 1, report["errors"]
        error = report["errors"][0]
        assert error["type"] == "RanksOutOfStepError" and "StepRefusedError" in error["classes"]
        assert "rank 1" in error["message"]
        before, after = report["snapshots"][0]
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing updated
        assert report["steps"] == 3
    # the ranks pair again after the refusal: the same parameters everywhere
    assert all(torch.equal(a, b) for a, b in zip(reports[0]["final"], reports[1]["final"]))
    assert all(torch.equal(a, b) for a, b in zip(*(r["snapshots"][0][0] for r in reports)))


def test_ranks_cutting_their_batches_into_different_numbers_of_pieces_are_in_step(ddp_skips):
    reports = [r["pieces"] for r in ddp_skips]
    assert reports[0]["pieces"] != reports[1]["pieces"]  # the case under test occurs
    assert reports[0]["steps"] == reports[1]["steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(reports[0]["final"], reports[1]["final"]))
