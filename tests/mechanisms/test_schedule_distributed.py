"""The group schedule under DDP / DPDDP (2 gloo processes, different data on every rank): after
early breaks every rank continues at the optimizer's step, so the global batch of released step
``t`` comes from group ``t mod b`` and each example is at least ``b`` steps from its last use."""

import math

import pytest
import torch

from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import dataset
from tests.mechanisms.workers_schedule import BANDS, BREAK_AT, PASSES, banded_ddp_breaks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("wrapper", ["dpddp"])
def test_every_rank_continues_the_schedule_after_a_break(wrapper, tmp_path):
    ranks = run_on_ranks(banded_ddp_breaks, 2, wrapper, str(tmp_path), timeout=240)
    steps = PASSES * (BREAK_AT + 1)
    assert [r["steps"] for r in ranks] == [steps, steps]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["after"], ranks[1]["after"]))
    table = dataset(80).tensors[0]
    last = {}
    for t in range(steps):
        x = torch.cat([r["rows"][t] for r in ranks])
        indices = [int((table == row).all(1).nonzero()) for row in x]
        assert all(int(ranks[0]["assignment"][i]) == t % BANDS for i in indices)
        for i in indices:
            assert t - last.get(i, -math.inf) >= BANDS
            last[i] = t
    rates = [q for _, q, n in ranks[0]["history"] for _ in range(n)]
    assert [q > 0 for q in rates] == [t % BANDS == 0 for t in range(steps)]
