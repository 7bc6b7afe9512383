"""Banded noise under DDP / DPDDP on 2 gloo processes, different data on every rank: the update
of every step is the clipped sum of the global batch plus the noise of one single-process
:class:`CorrelatedNoise` drawn from the same generator (rank 0 adds it once)."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.mechanisms.noise import CorrelatedNoise
from opacus_dp.mechanisms.strategies import make_strategy
from opacus_dp.optim import GaussianNoise
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from tests.distributed.oracle import clipped_sum, per_sample_grads
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import dataset, make_model
from tests.mechanisms.workers import BANDS, CLIP, NOISE_SEED, SIGMA, banded_ddp_run

pytestmark = pytest.mark.distributed


DRAWS = {False: GaussianNoise, True: ParallelGaussianNoise, "philox": PhiloxGaussianNoise}


@pytest.mark.parametrize("wrapper,fast_noise", [("ddp", False), ("dpddp", False), ("ddp", "philox"), ("dpddp", True)])
def test_banded_noise_is_added_once_and_equals_the_single_process_noise(wrapper, fast_noise, tmp_path):
    """With each generator (``fast_noise``): the single process's noise from the same generator."""
    cache = str(tmp_path)
    ranks = run_on_ranks(banded_ddp_run, 2, wrapper, cache, fast_noise, timeout=300)
    steps = len(ranks[0]["steps"])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["after"], ranks[1]["after"]))
    assert [e[1] for e in ranks[0]["history"]] == [ranks[0]["group_rate"], 0.0] * (steps // 2)
    strategy = make_strategy("banded", steps=8, bands=BANDS, cache_dir=cache)  # one pass of 8 steps
    oracle = CorrelatedNoise(strategy, DRAWS[fast_noise](torch.Generator().manual_seed(NOISE_SEED)))
    model = make_model(seed=0)
    for t in range(steps):
        with torch.no_grad():
            for p, value in zip(model.parameters(), ranks[0]["steps"][t]["before"]):
                p.copy_(value)
        x = torch.cat([r["steps"][t]["x"] for r in ranks])
        y = torch.cat([r["steps"][t]["y"] for r in ranks])
        params = list(model.parameters())
        total = clipped_sum(per_sample_grads(model, nn.CrossEntropyLoss(), x, y), CLIP, params)
        oracle.begin_step(torch.device("cpu"))
        noise = [oracle.sample(p.detach().double(), SIGMA * CLIP) for p in params]
        for s, z, g in zip(total, noise, ranks[0]["steps"][t]["grads"]):
            torch.testing.assert_close(g * ranks[0]["global_batch"], s + z, rtol=1e-6, atol=1e-6)
        rows = dataset(80).tensors[0]
        indices = [int((rows == row).all(1).nonzero()) for row in x]
        assert all(int(ranks[0]["assignment"][i]) == t % BANDS for i in indices)
