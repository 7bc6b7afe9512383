"""A step refused on one rank alone is refused on every rank, in the step's own all-reduce; a
rank that never arrives is named after ``step_timeout`` (2 gloo processes, different data on
each rank, σ = 0, clipping active).

Without this, the refusing rank raised before the all-reduce, a loop that caught the error went
on, and that rank's next all-reduce paired with the others' current one: the ranks trained one
step apart (or hung until the process group's 30-minute timeout).
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.optim.step_refusal import BUDGET, EARLIER_PIECE, NON_FINITE, TOO_MANY_SAMPLES
from tests.distributed.oracle import clipped_mean_update, sgd_step
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import FLAT_C, LR, make_model
from tests.distributed.workers_refusal import BAD_STEP, STEPS, absent_rank_job, refusal_job

pytestmark = pytest.mark.distributed
WORLD = 2
STEP_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def refusals():
    return run_on_ranks(refusal_job, WORLD, timeout=240)


def oracle(reports):
    """One process on the concatenated batches of the steps that went through (σ = 0)."""
    model = make_model(seed=0)
    with torch.no_grad():
        for p, value in zip(model.parameters(), reports[0]["start"]):
            p.copy_(value)
    for step in range(STEPS):
        if reports[0]["errors"][step] is not None:
            continue
        x = torch.cat([x for r in reports for x, _ in r["batches"][step]])
        y = torch.cat([y for r in reports for _, y in r["batches"][step]])
        update = clipped_mean_update(model, nn.CrossEntropyLoss(), x, y, FLAT_C, reports[0]["global_batch"])
        sgd_step(model, update, LR)
    return [p.detach() for p in model.parameters()]


def check_refused_once_then_in_step(reports, code, own_words):
    r0, r1 = reports
    for step in range(STEPS):
        refused = step == BAD_STEP
        assert (r0["errors"][step] is not None) == refused, (step, r0["errors"][step])
        assert (r1["errors"][step] is not None) == refused, (step, r1["errors"][step])
    peer, own = r0["errors"][BAD_STEP], r1["errors"][BAD_STEP]
    assert peer["peer"] and peer["refusals"] == {1: code}, peer
    assert "rank 1 refused this step" in peer["message"], peer["message"]
    assert not own["peer"] and own_words in own["message"], own["message"]
    for r in reports:
        assert r["unchanged"][BAD_STEP] and r["grads_kept"][BAD_STEP], "a refused step changed something"
        assert r["recorded"] == r["steps_taken"] == STEPS - 1
    assert r0["history"] == r1["history"]
    assert all(torch.equal(a, b) for a, b in zip(r0["final"], r1["final"])), "the ranks fell out of step"
    for got, want in zip(r0["final"], oracle(reports)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["dpddp", "ddp"])
def test_nan_on_one_rank_refuses_the_step_everywhere_and_ranks_stay_in_step(refusals, wrapper):
    reports = [r[f"nan_{wrapper}"] for r in refusals]
    check_refused_once_then_in_step(reports, NON_FINITE, "non-finite")
    assert "non-finite" in reports[0]["errors"][BAD_STEP]["message"]  # the reason travels


def test_budget_guard_on_one_rank_refuses_the_step_everywhere(refusals):
    reports = [r["budget"] for r in refusals]
    check_refused_once_then_in_step(reports, BUDGET, "privacy budget exhausted")
    assert reports[0]["errors"][BAD_STEP]["budget"], "peers must raise a PrivacyBudgetExceededError too"


def test_batch_over_max_batch_size_on_one_rank_refuses_the_step_everywhere(refusals):
    reports = [r["batch_size"] for r in refusals]
    check_refused_once_then_in_step(reports, TOO_MANY_SAMPLES, "more than one logical batch")


def test_failed_virtual_step_on_one_rank_refuses_the_logical_batch_everywhere(refusals):
    reports = [r["piece"] for r in refusals]
    assert [e["type"] for e in reports[1]["piece_errors"]] == ["NonFiniteNormError"]  # a ValueError with its reason as a type
    assert reports[0]["piece_errors"] == []
    check_refused_once_then_in_step(reports, EARLIER_PIECE, "an earlier piece of it failed")


@pytest.mark.parametrize("absent", [1, 0])
def test_a_rank_that_never_arrives_is_named_within_the_step_timeout(tmp_path, absent):
    marker = str(tmp_path / "reported")
    reports = run_on_ranks(absent_rank_job, WORLD, absent, marker, STEP_TIMEOUT, timeout=90)
    present = reports[1 - absent]
    assert reports[absent]["absent"] and not present["absent"]
    assert present["message"] is not None, "the step did not raise"
    assert present["missing"] == [absent]
    assert f"rank {absent} did not join it" in present["message"], present["message"]
    assert "restart" in present["message"]
    assert STEP_TIMEOUT - 0.5 < present["elapsed"] < STEP_TIMEOUT + 4, present["elapsed"]
    assert present["recorded"] == 1  # the timed-out step was not recorded
