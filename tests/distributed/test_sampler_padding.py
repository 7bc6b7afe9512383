"""A DistributedSampler that pads its shards (drop_last=False, N not divisible by the world size)
repeats examples across the ranks of one step: refused for a loader kept as it is
(poisson_sampling=False). Single-process checks of the loader check make_private runs."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from opacus_dp.engine.private_step import check_distributed_loader


def _loader(n: int, replicas: int = 2, drop_last: bool = False, sampler_class=DistributedSampler) -> DataLoader:
    data = TensorDataset(torch.arange(n).float())
    return DataLoader(data, batch_size=8,
                      sampler=sampler_class(data, num_replicas=replicas, rank=0, drop_last=drop_last))


class _MySampler(DistributedSampler):
    pass


def test_padding_sampler_is_refused_naming_the_fixes():
    with pytest.raises(ValueError) as refused:
        check_distributed_loader(_loader(65), world_size=2, poisson_sampling=False)
    message = str(refused.value)
    for part in ("DistributedSampler(drop_last=False)", "65 examples", "num_replicas=2", "repeating 1 ",
                 "sensitivity 2C", "DistributedSampler(dataset, drop_last=True)", "poisson_sampling=True"):
        assert part in message


def test_padding_count_is_the_shortfall_to_a_multiple_of_the_world():
    with pytest.raises(ValueError, match="5 examples to a multiple of num_replicas=4 by repeating 3 "):
        check_distributed_loader(_loader(5, replicas=4), world_size=4, poisson_sampling=False)


def test_subclass_and_explicit_batch_sampler_are_refused_too():
    with pytest.raises(ValueError, match="_MySampler"):
        check_distributed_loader(_loader(65, sampler_class=_MySampler), world_size=2, poisson_sampling=False)
    data = TensorDataset(torch.arange(65).float())
    batches = BatchSampler(DistributedSampler(data, num_replicas=2, rank=1), batch_size=8, drop_last=False)
    with pytest.raises(ValueError, match="sensitivity 2C"):
        check_distributed_loader(DataLoader(data, batch_sampler=batches), world_size=2, poisson_sampling=False)


@pytest.mark.parametrize("n, drop_last, poisson_sampling", [
    (65, True, False),   # the tail is left out, no example repeated
    (64, False, False),  # nothing to pad
    (65, False, True),   # the engine replaces the sampler by disjoint Poisson batches
])
def test_loaders_without_repeats_are_accepted(n, drop_last, poisson_sampling):
    check_distributed_loader(_loader(n, drop_last=drop_last), world_size=2, poisson_sampling=poisson_sampling)


def test_one_process_has_no_other_rank_to_repeat_on():
    check_distributed_loader(_loader(65, replicas=1), world_size=1, poisson_sampling=False)


def test_sharding_for_another_world_is_still_refused_first():
    with pytest.raises(ValueError, match="num_replicas=2 processes but the process group has world_size=3"):
        check_distributed_loader(_loader(65), world_size=3, poisson_sampling=False)
