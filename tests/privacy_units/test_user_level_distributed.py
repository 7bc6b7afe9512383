"""User-level DP-SGD across 2 gloo processes: users are sharded across the ranks (never split),
each rank's BatchMemoryManager cuts between users, and the σ = 0 update equals the one-process
per-user oracle over the union of the ranks' users; ranks given different user_ids are refused. The same
for augmentation multiplicity under DDP (every example 2 rows, accounted per example)."""

import pytest
import torch
import torch.nn as nn

from tests.distributed.oracle import sgd_step
from tests.distributed.spawn import run_on_ranks
from tests.privacy_units.models import make_data, make_model
from tests.privacy_units.oracle import unit_update
from tests.privacy_units.workers import C, LR, STEPS, user_level_job

pytestmark = pytest.mark.distributed
WORLD = 2


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(user_level_job, WORLD, timeout=240)


@pytest.mark.parametrize("name,unit_gradient", [("dpddp-hooks", "mean"), ("ddp-bk", "mean"), ("fsdp-bk", "sum"),
                                                ("ddp-augmult", "mean")])
def test_update_equals_oracle_over_all_ranks(reports, name, unit_gradient):
    ranks = [r[name] for r in reports]
    _, users = make_data("mlp")
    user_of = dict(enumerate(users.tolist()))
    reference = make_model("mlp")
    with torch.no_grad():
        for p, value in zip(reference.parameters(), ranks[0]["start"]):
            p.copy_(value)
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == STEPS
    pieces = 0
    for step in range(STEPS):
        parts = [r["steps"][step] for r in ranks]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        sizes = [s for p in parts for s in p[2]]
        pieces = max(pieces, *(p[3] for p in parts))
        if name != "ddp-augmult":  # users: none on both ranks
            rows = [[user_of[i] for i in range(36) if any(torch.equal(make_data("mlp")[0].tensors[0][i], xr)
                                                             for xr in p[0])] for p in parts]
            assert not set(rows[0]) & set(rows[1]), "a user's examples reached both ranks"
        else:  # augmentation multiplicity: every example is 2 consecutive rows
            assert all(s == 2 for s in sizes)
        sgd_step(reference, unit_update(reference, nn.functional.cross_entropy, x, y, sizes, C,
                                        ranks[0]["divisor"], unit_gradient), LR)
    assert pieces > 1
    for rank in ranks:
        for p, value in zip(reference.parameters(), rank["final"]):
            torch.testing.assert_close(value, p.detach(), rtol=1e-5, atol=1e-6)
        assert rank["unit"] == ("example" if name == "ddp-augmult" else "user")
        assert rank["history"] == ranks[0]["history"] == [(0.0, rank["rate"], STEPS)]


def test_ranks_with_different_user_ids_are_refused(reports):
    for r in reports:
        assert r["refusal"] is not None and "split across ranks" in r["refusal"]
