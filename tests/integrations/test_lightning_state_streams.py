"""Restoring the DPCallback's private state (``lightning_state.restore_private_state``) on the
ranks of a sharded model: a Lightning checkpoint is written by rank 0 and loaded on every rank, so
each rank must continue a noise stream of its own (under FSDP2 each rank noises its own shard), and
the same rank twice the same one. Under other reducers the loaded stream is kept as saved.

Oracle: the noise each restored optimizer draws, compared across ranks and restores."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from opacus_dp.accountants import create_accountant  # noqa: E402
from opacus_dp.integrations.lightning_state import NOISE_ENTRY, restore_private_state  # noqa: E402
from opacus_dp.optim.noise import GaussianNoise  # noqa: E402


class RankOptimizer:
    """What ``restore_private_state`` reads of a DPOptimizer, on rank ``rank`` of a reducer that
    shards (FSDP2) or not."""

    def __init__(self, rank: int, shards: bool):
        self.reducer = SimpleNamespace(rank=rank, shards=shards)
        self.noise = GaussianNoise(generator=torch.Generator().manual_seed(100 + rank))
        self.steps_taken = 0

    def load_noise_state_dict(self, state):
        self.noise.load_state_dict(state)

    def clipping_state_dict(self):
        return {}

    def draws(self) -> torch.Tensor:
        return self.noise.sample(torch.zeros(4000), 1.0)


def saved_state():
    rank0 = GaussianNoise(generator=torch.Generator().manual_seed(7))
    rank0.sample(torch.zeros(10), 1.0)  # a generator that has advanced
    accountant = create_accountant("rdp")
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    return {"privacy_accountant_state_dict": accountant.state_dict(), "dp_optimizer_steps": 1,
            NOISE_ENTRY: rank0.state_dict()}, rank0


def restored(rank: int, shards: bool) -> RankOptimizer:
    state, _ = saved_state()
    optimizer = RankOptimizer(rank, shards)
    restore_private_state(state, optimizer=optimizer, accountant=create_accountant("rdp"), sampler_generator=None,
                          secure_mode=False)
    return optimizer


def test_sharded_ranks_restored_from_rank_0s_state_draw_independent_reproducible_noise():
    rank0, rank1 = restored(0, shards=True).draws(), restored(1, shards=True).draws()
    correlation = torch.corrcoef(torch.stack([rank0, rank1]))[0, 1]
    assert abs(float(correlation)) < 5 / 4000 ** 0.5  # five standard errors of independent draws
    assert torch.equal(restored(1, shards=True).draws(), rank1)


def test_without_sharding_the_saved_stream_continues_as_saved():
    _, rank0_noise = saved_state()
    assert torch.equal(restored(0, shards=False).draws(), rank0_noise.sample(torch.zeros(4000), 1.0))
