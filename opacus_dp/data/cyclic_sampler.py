"""Cyclic Poisson sampling: the sampling of amplified banded matrix factorisation.

Every example index is assigned to one of ``b`` groups, independently and uniformly, by a
generator seeded with the public ``partition_seed`` (the analysis holds for any assignment fixed
before seeing the data; every process and resumed run finds the same one, and the assignment
of the first ``N`` indices does not depend on how many follow); step ``t`` draws a Poisson
batch (each example independently with probability ``group_rate``) from group ``t mod b`` only. So an example can take part at
most once in any ``b`` consecutive steps ("b-min-separated" participation) and at most
``⌈T/b⌉`` times in ``T`` steps (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization", §4). With ``group_rate = 1`` the batches are the groups themselves, in a fixed
cyclic order (every example once every ``b`` steps). With ``num_replicas`` processes sharing
the generator's state, each draws the same global batch and keeps its share ``rank::R`` of it.

A pass has ``steps`` batches, a multiple of ``b``, so every pass starts with group 0 and the
``t``-th step of a run (complete passes) uses group ``t mod b``.
"""

from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler

from opacus_dp.data.samplers import check_positive_int, check_sample_rate, poisson_mask


class CyclicPoissonSampler(Sampler[List[int]]):
    """Batch sampler of the module doc over ``range(num_samples)``; ``generator`` draws the
    Poisson masks."""

    def __init__(self, num_samples: int, *, groups: int, group_rate: float, generator=None,
                 steps: Optional[int] = None, partition_seed: int = 0, rank: int = 0,
                 num_replicas: int = 1):
        self.num_samples = check_positive_int(num_samples, "num_samples")
        self.groups = check_positive_int(groups, "groups")
        if self.groups > self.num_samples:
            raise ValueError(f"cannot split {num_samples} examples into {groups} non-empty groups")
        self.sample_rate = check_sample_rate(group_rate)
        self.generator = generator
        steps = self.groups if steps is None else check_positive_int(steps, "steps")
        self.steps = -(-steps // self.groups) * self.groups
        self.rank, self.num_replicas = int(rank), check_positive_int(num_replicas, "num_replicas")
        self.assignment = torch.randint(0, self.groups, (self.num_samples,),
                                        generator=torch.Generator().manual_seed(int(partition_seed)))
        self.partition = [torch.nonzero(self.assignment == g).view(-1) for g in range(self.groups)]

    def __len__(self) -> int:
        return self.steps

    def group_of(self, step: int) -> torch.Tensor:
        """Indices of the group sampled at ``step``."""
        return self.partition[step % self.groups]

    def __iter__(self) -> Iterator[List[int]]:
        for step in range(self.steps):
            group = self.group_of(step)
            chosen = group[poisson_mask(len(group), self.sample_rate, self.generator)]
            yield chosen[self.rank::self.num_replicas].tolist()

    def expected_batch_size(self) -> float:
        """``q_g · N / (b · R)`` (averaged over the groups), per process."""
        return self.num_samples * self.sample_rate / (self.groups * self.num_replicas)
