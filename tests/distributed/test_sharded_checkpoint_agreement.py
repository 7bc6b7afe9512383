"""FSDP2 checkpoint directories under fault and misuse, 2 gloo processes on CPU.

* Loading: every rank checks its own file before any collective of torch's distributed
  checkpoint, the ranks agree, and every rank raises the same error naming the failing rank, its
  file and the reason (a rank file deleted, rank 0's signed file altered, the rank files
  swapped, files of two saves mixed); the ranks can then catch it and train on together.
* Saving: a rank whose write fails makes every rank raise; a rank that dies mid-save leaves the
  previous checkpoint in place, loadable on every rank and equal to what was saved (the oracle:
  the state the saving run had, and its parameters one step later).

Two spawned jobs (``workers_sharded_checkpoint``), each under a timeout shorter than the process
group's.
"""

import math

import pytest
import torch

from opacus_dp.accountants import RDPAccountant
from tests.distributed.workers_fsdp import DELTA
from tests.distributed.workers_sharded_checkpoint import crash_job, refusal_job, run_job

pytestmark = pytest.mark.distributed
WORLD = 2
JOB_TIMEOUT_S = 120  # below the jobs' process-group timeout (workers_sharded_checkpoint.GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp_agreement")
    crash = run_job(crash_job, WORLD, str(directory), timeout=JOB_TIMEOUT_S, may_die=(1,))
    refusal = run_job(refusal_job, WORLD, str(directory / "refusals"), str(directory / "crashed"),
                      timeout=JOB_TIMEOUT_S)
    return {"crash": crash, "refusal": refusal}


def assert_same_state(got, want):
    assert got["steps"] == want["steps"] and got["history"] == want["history"]
    assert got["epsilon"] == want["epsilon"]
    for a, b in zip(got["params"], want["params"]):
        assert torch.equal(a, b)


def assert_resumes(loaded, saved):
    """``loaded`` (a fresh run that loaded the checkpoint) equals the run that saved it, then and
    one step later (noise streams, sampler and Adam state restored)."""
    assert_same_state(loaded["saved"], saved["saved"])
    for a, b in zip(loaded["next"], saved["next"]):
        assert torch.equal(a, b)


def same_error_on_every_rank(reports, case):
    errors = [r[case] for r in reports]
    assert errors[0]["type"] is not None, "the load was not refused"
    assert all(e == errors[0] for e in errors), errors  # same type, message and reasons everywhere
    return errors[0]


def test_a_deleted_rank_file_is_refused_on_every_rank_naming_it(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "deleted")
    assert error["refusals"] == {1: "MISSING_FILE"}
    assert "rank 1" in error["message"] and "private_rank1.pt" in error["message"]
    assert "nothing was loaded" in error["message"]


def test_an_altered_signed_file_is_refused_on_every_rank_naming_it(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "altered")
    assert error["refusals"] == {0: "SIGNATURE"}
    assert error["type"] == "ShardedCheckpointIntegrityError"
    assert "rank 0" in error["message"] and "private_rank0.pt" in error["message"]
    assert "signature" in error["message"]


def test_swapped_rank_files_are_refused_saying_which_rank_wrote_them(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "swapped")
    assert error["refusals"] == {0: "WRONG_RANK", 1: "WRONG_RANK"}
    assert "private_rank0.pt was written by rank 1" in error["message"]
    assert "private_rank1.pt was written by rank 0" in error["message"]
    assert "number of processes" not in error["message"]


def test_rank_files_of_different_saves_are_refused_on_every_rank(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "mixed")
    assert error["refusals"] == {0: "DIFFERENT_RUNS", 1: "DIFFERENT_RUNS"}
    assert "2 steps (rank 0), 3 steps (rank 1)" in error["message"]


def test_ranks_that_catch_a_refused_load_train_on_together(jobs):
    fresh = [r["fresh"] for r in jobs["refusal"]]
    reference = RDPAccountant()
    for _ in range(2):
        reference.step(noise_multiplier=0.8, sample_rate=1 / 8)
    for report in fresh:
        assert report["steps"] == report["history"] == 2  # nothing of the refused checkpoint
        assert report["epsilon"] == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    for a, b in zip(fresh[0]["params"], fresh[1]["params"]):
        assert torch.equal(a, b)


def test_a_failed_write_on_one_rank_fails_the_save_on_every_rank(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "write_failure")
    assert error["refusals"] == {1: "WRITE_FAILED"}
    assert "rank 1" in error["message"] and "private_rank1.pt" in error["message"]
    for report in jobs["refusal"]:  # the previous checkpoint is untouched
        assert_resumes(report["after_write_failure"], report["base"])
    assert jobs["refusal"][0]["leftovers"] == ["base"]


def test_an_unsavable_entry_on_one_rank_fails_the_save_on_every_rank_before_writing(jobs):
    error = same_error_on_every_rank(jobs["refusal"], "unsafe_entry")
    assert error["refusals"] == {1: "UNSAVABLE_STATE"} and "rank 1" in error["message"]
    for report in jobs["refusal"]:  # checked after both failed saves: the previous one is untouched
        assert_resumes(report["after_write_failure"], report["base"])


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_loadable(jobs):
    crash, refusal = jobs["crash"], jobs["refusal"]
    assert crash[1] is None  # rank 1 died while writing its file
    message = crash[0]["crash"]["message"]
    assert crash[0]["crash"]["type"] == "ShardedCheckpointError" and "rank 1" in message
    # parameters are gathered whole, so rank 0's report of the saved run is rank 1's too
    expected = {"saved": crash[0]["saved"], "next": crash[0]["next"]}
    for report in refusal:
        assert_resumes(report["crashed"], expected)
    assert refusal[0]["after_resave"] == ["crashed", "refusals"]


def test_jobs_ran_with_noise(jobs):
    """The states compared above differ from step to step (σ > 0, Adam)."""
    base = jobs["refusal"][0]["base"]
    assert not all(torch.equal(a, b) for a, b in zip(base["saved"]["params"], base["next"]))
    assert math.isfinite(base["saved"]["epsilon"])
