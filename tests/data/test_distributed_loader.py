"""DPDataLoader(distributed=True) on two real gloo processes: ranks stay in step, shards are disjoint."""

import pytest
import torch
from torch.utils.data import TensorDataset

from opacus_dp.data import DPDataLoader, UniformWithReplacementSampler
from tests.distributed.spawn import run_on_ranks

N, Q, STEPS = 21, 0.1, 30


def draw_local_batches(rank, world_size):
    """Runs on each rank: every rank seeds the global RNG alike, so the loaders share a seed."""
    torch.manual_seed(0)
    loader = DPDataLoader(TensorDataset(torch.arange(N)), sample_rate=Q, steps=STEPS, distributed=True)
    shard = loader.batch_sampler.shard_indices().tolist()
    batches = [batch[0].tolist() for batch in loader]
    # every rank takes part in one collective per step: a rank with fewer batches would hang
    for _ in batches:
        torch.distributed.all_reduce(torch.ones(1))
    return {"shard": shard, "batches": batches}


@pytest.mark.distributed
def test_two_ranks_share_one_poisson_draw():
    results = run_on_ranks(draw_local_batches, 2, timeout=90)
    shards = [r["shard"] for r in results]
    assert sorted(shards[0] + shards[1]) == list(range(N))
    assert [len(r["batches"]) for r in results] == [STEPS, STEPS]
    for t in range(STEPS):
        local = [results[r]["batches"][t] for r in range(2)]
        assert set(local[0]) <= set(shards[0]) and set(local[1]) <= set(shards[1])
    assert any(len(results[r]["batches"][t]) == 0 for r in range(2) for t in range(STEPS))
    # oracle: with a shared seed, the union of the local batches at step t is exactly the set of
    # examples whose permuted position j satisfies U_j < q, U drawn as by a single-process sampler
    torch.manual_seed(0)
    generator = DPDataLoader(TensorDataset(torch.arange(N)), sample_rate=Q).generator
    positions = list(UniformWithReplacementSampler(num_samples=N, sample_rate=Q, generator=generator, steps=STEPS,
                                                   skip_empty=False))
    order = [None] * N
    for r in range(2):
        for k, index in enumerate(shards[r]):
            order[r + 2 * k] = index
    for t in range(STEPS):
        union = sorted(results[0]["batches"][t] + results[1]["batches"][t])
        assert union == sorted(order[j] for j in positions[t])
