"""Units of the FSDP2 support on a one-process gloo group: the sharding recipe of ``fsdp=True``,
the optimizer pointed at the shards, the per-rank noise seeds and the shard layout."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from opacus_dp.distributed.fsdp import parameter_groups, rebind_optimizer, shard_model, shard_rows
from opacus_dp.distributed.noise_streams import rank_seed
from opacus_dp.optim.noise import GaussianNoise

pytestmark = pytest.mark.usefixtures("group")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 6), nn.Linear(6, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.ModuleList([nn.Linear(6, 6)]))
                                    for _ in range(3))


def test_the_recipe_shards_the_outermost_listed_blocks_then_the_root():
    model = shard_model(Net())
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert sharded == ["", "blocks.0", "blocks.1", "blocks.2"]  # not inp/out, not the inner list
    groups = parameter_groups(model)
    assert groups[model.inp.weight] == groups[model.out.bias] == 0
    assert len({groups[p] for p in model.blocks[1].parameters()}) == 1 != groups[model.inp.weight]


def test_blocks_named_by_class():
    model = shard_model(Net(), blocks=(nn.Sequential,))
    assert sum(isinstance(m, FSDPModule) for m in model.modules()) == 4


def test_the_optimizer_is_pointed_at_the_shards_with_its_settings():
    model = Net()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([{"params": list(model.inp.parameters()), "lr": 0.5},
                                   {"params": list(model.blocks.parameters())}], lr=0.1, weight_decay=0.3)
    shard_model(model)
    assert rebind_optimizer(optimizer, names, model) is optimizer
    shards = dict(model.named_parameters())
    assert optimizer.param_groups[0]["params"] == [shards["inp.weight"], shards["inp.bias"]]
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    assert optimizer.param_groups[1]["weight_decay"] == 0.3


def test_an_optimizer_of_other_parameters_is_refused():
    model, stranger = Net(), nn.Linear(2, 2)
    names = {p: n for n, p in model.named_parameters()}
    shard_model(model)
    with pytest.raises(ValueError, match="do not belong"):
        rebind_optimizer(torch.optim.SGD(stranger.parameters(), lr=0.1), names, model)


def test_rank_seeds_are_distinct_and_reproducible():
    noise = GaussianNoise(generator=torch.Generator().manual_seed(3))
    base = noise.stream_base()
    seeds = [rank_seed(base, r) for r in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2 ** 62 for s in seeds)
    assert seeds == [rank_seed(base, r) for r in range(64)]
    other = GaussianNoise(generator=torch.Generator().manual_seed(4)).stream_base()
    assert rank_seed(other, 0) != seeds[0]


def test_reseeding_leaves_the_users_generator_alone():
    users = torch.Generator().manual_seed(3)
    state = users.get_state()
    noise = GaussianNoise(generator=users)
    noise.reseed(rank_seed(noise.stream_base(), 1))
    assert noise.generator is not users and torch.equal(users.get_state(), state)
    with pytest.raises(ValueError, match="secure"):
        GaussianNoise(secure_mode=True).reseed(1)


def test_shard_rows_follow_fsdp2s_layout():
    model = shard_model(Net())
    for p in model.parameters():
        chunk, local, offset = shard_rows(p)
        assert (chunk, local, offset) == (p.shape[0], p.shape[0], 0)  # one rank holds everything
        assert p.to_local().shape == p.shape
