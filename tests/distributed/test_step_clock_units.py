"""The step clock (opacus_dp.distributed.step_clock) in one process: tables built by hand, batches
counted where the DP loaders hand them out."""

import pytest
import torch

from opacus_dp.data.batch_memory_manager import BatchSplittingSampler
from opacus_dp.data.samplers import DistributedPoissonBatchSampler, logical_batches_handed_out
from opacus_dp.data.unit_sampling import UnitPoissonSampler
from opacus_dp.distributed import RanksOutOfStepError, StepRefusedError
from opacus_dp.distributed.agreement import agreement_rows, check_table
from opacus_dp.distributed.step_clock import BACKWARD, FORWARD, STEP, StepClock, check_clock
from opacus_dp.optim.step_refusal import OUT_OF_STEP, REASONS


def _table(*readings, shards=None):
    shards = shards or [0] * len(readings)
    return torch.tensor([[float(p), float(b), float(s)] for (p, b), s in zip(readings, shards)], dtype=torch.float64)


def test_ranks_in_step_pass():
    check_clock(_table((STEP, 1), (STEP, 1), (STEP, 1)))


def test_a_rank_with_one_more_batch_is_named_and_every_reading_reported():
    with pytest.raises(RanksOutOfStepError) as caught:
        check_clock(_table((STEP, 1), (STEP, 2), (STEP, 1)))
    error = caught.value
    assert isinstance(error, StepRefusedError)
    assert error.refusals == {1: OUT_OF_STEP} and OUT_OF_STEP in REASONS
    assert error.clock == {0: (STEP, 1), 1: (STEP, 2), 2: (STEP, 1)}
    assert "rank 1 in optimizer.step() after 2 batches" in str(error)
    assert "rank 0 in optimizer.step() after 1 batch since" in str(error)


def test_with_two_ranks_the_one_with_more_batches_is_named_whichever_it_is():
    for skipper in (0, 1):
        readings = [(BACKWARD, 1), (BACKWARD, 1)]
        readings[skipper] = (FORWARD, 2)
        with pytest.raises(RanksOutOfStepError) as caught:
            check_clock(_table(*readings))
        assert caught.value.refusals == {skipper: OUT_OF_STEP}


def test_ranks_in_different_phases_are_out_of_step():
    with pytest.raises(RanksOutOfStepError) as caught:
        check_clock(_table((BACKWARD, 1), (FORWARD, 1)))
    assert "rank 0 in a backward pass" in str(caught.value) and "rank 1 in a forward pass" in str(caught.value)


def test_the_clock_is_checked_before_a_refusal_or_the_settings():
    rows = [agreement_rows([1.0, 2.0], torch.empty(0, dtype=torch.float64), refusal, 2, rank, [STEP, batches, 0])
            for rank, refusal, batches in ((0, None, 1), (1, 2, 2))]
    with pytest.raises(RanksOutOfStepError):
        check_table(["a", "b"], rows[0] + rows[1], clock_columns=3)
    same = [agreement_rows([1.0, 2.0], torch.empty(0, dtype=torch.float64), None, 2, r, [STEP, 1, 0]) for r in (0, 1)]
    check_table(["a", "b"], same[0] + same[1], clock_columns=3)


def test_the_clock_counts_logical_batches_since_the_last_step():
    clock = StepClock()
    sampler = DistributedPoissonBatchSampler(total_size=20, sample_rate=0.5, num_replicas=2, rank=0,
                                             generator=torch.Generator().manual_seed(0), steps=3)
    batches = iter(sampler)
    next(batches)
    assert clock.row(STEP) == [float(STEP), 1.0, 0.0]
    next(batches)
    assert clock.row(FORWARD) == [float(FORWARD), 2.0, 0.0]
    clock.step_over()
    assert clock.row(STEP) == [float(STEP), 0.0, 0.0]


def test_batch_memory_manager_counts_a_logical_batch_once_not_its_draw():
    sampler = DistributedPoissonBatchSampler(total_size=40, sample_rate=0.5, num_replicas=2, rank=0,
                                             generator=torch.Generator().manual_seed(0), steps=3)
    splitter = BatchSplittingSampler(batch_sampler=sampler, max_batch_size=2)
    before = logical_batches_handed_out()
    pieces = list(splitter)
    assert len(pieces) > 3  # the batches were cut into pieces
    assert logical_batches_handed_out() == before  # the loader counts them as they reach the loop


def test_ranks_of_different_shard_assignments_are_out_of_step():
    with pytest.raises(RanksOutOfStepError) as caught:
        check_clock(_table((STEP, 1), (STEP, 1), (STEP, 1), shards=[3, 4, 3]))
    assert caught.value.refusals == {1: OUT_OF_STEP} and "set_epoch" in str(caught.value)
    check_clock(_table((STEP, 1), (STEP, 1), shards=[4, 4]))


@pytest.mark.parametrize("units", [False, True])
def test_a_pass_notes_its_shard_assignment_on_the_clock(units):
    if units:
        sampler = UnitPoissonSampler([[0, 1], [2], [3, 4, 5]], sample_rate=0.5, num_replicas=2, rank=1,
                                     distributed=True, shuffle_seed=7, generator=torch.Generator().manual_seed(0))
    else:
        sampler = DistributedPoissonBatchSampler(total_size=20, sample_rate=0.5, num_replicas=2, rank=1,
                                                 shuffle_seed=7, generator=torch.Generator().manual_seed(0))
    sampler.set_epoch(2)
    next(iter(sampler))
    assert StepClock().row(STEP)[2] == 9.0  # shuffle_seed + epoch


def test_a_large_shuffle_seed_stays_told_apart_in_a_bfloat16_bucket():
    """The DDP table rides in the first gradient bucket, bfloat16 for a bfloat16 model: 1000 + 1
    and 1000 + 2 round to the same bfloat16, their residues modulo 256 do not."""
    columns = []
    for epoch in (1, 2):
        sampler = DistributedPoissonBatchSampler(total_size=20, sample_rate=0.5, num_replicas=2, rank=0,
                                                 shuffle_seed=1000, generator=torch.Generator().manual_seed(0))
        sampler.set_epoch(epoch)
        next(iter(sampler))
        columns.append(torch.tensor(StepClock().row(STEP), dtype=torch.bfloat16))
    assert torch.tensor(1001.0, dtype=torch.bfloat16) == torch.tensor(1002.0, dtype=torch.bfloat16)
    with pytest.raises(RanksOutOfStepError, match="set_epoch"):
        check_clock(torch.stack(columns).double())
