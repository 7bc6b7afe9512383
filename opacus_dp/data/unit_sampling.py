"""Poisson sampling over privacy units: users who own several examples, and examples seen
through several augmentations.

Each step includes every unit ``u`` independently with probability ``q`` (the rate the accountant
records: a user-level guarantee for users, Chua et al. 2024, "Mind the Privacy Unit!"). A sampled
user contributes at most ``k`` of its ``n_u`` examples (``max_examples_per_user``): all of them if
``n_u ≤ k``, else a uniformly random ``k``-subset drawn afresh each step; with
``augmentation_multiplicity=K`` each chosen example appears ``K`` times in a row, so the dataset's
random transform makes ``K`` augmentations of it (De et al. 2022). A unit's rows are consecutive;
the batch's grouping (:class:`~opacus_dp.maths.unit_groups.UnitGroups`) is queued in
``sampler.layouts`` for the loader to deliver with the batch.

With several processes, rank ``r`` owns the units at positions ``r, r+R, ...`` of a permutation
seeded by ``shuffle_seed + epoch``: a user's examples are never split across ranks. Every rank
draws the same mask over all units and the same subsets (a shared generator), so the union of the
local batches is one global Poisson sample of units.
"""

import math
from collections import deque
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from opacus_dp.data.samplers import (check_positive_int, check_sample_rate, count_logical_batch, default_steps,
                                     distributed_world, log_state_after_draw, note_shard_assignment,
                                     poisson_mask)
from opacus_dp.maths.unit_groups import UNIT_GRADIENTS, UnitGroups


def units_of(user_ids, num_examples: int) -> List[List[int]]:
    """The example indices of every user, users in sorted order of their ids (first-appearance
    order if the ids do not sort); ``user_ids[i]`` is the user of example ``i``."""
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1:
            raise ValueError(f"user_ids must be one-dimensional, got shape {tuple(user_ids.shape)}")
        user_ids = user_ids.tolist()
    try:
        user_ids = list(user_ids)
    except TypeError:
        raise TypeError(f"user_ids must be a sequence or a 1-D tensor, got {type(user_ids).__name__}") from None
    if len(user_ids) != num_examples:
        raise ValueError(f"user_ids has {len(user_ids)} entries but the dataset has {num_examples} examples: "
                         "user_ids[i] must be the user of example i, one per example")
    if any(u is None for u in user_ids):
        raise ValueError("user_ids contains None: every example needs a user")
    user_ids = [_id_value(u, i) for i, u in enumerate(user_ids)]
    members: Dict[object, List[int]] = {}
    for i, u in enumerate(user_ids):
        members.setdefault(u, []).append(i)
    try:
        order = sorted(members)
    except TypeError:
        order = list(members)
    return [members[u] for u in order]


def _id_value(user, index: int):
    """The id of example ``index``'s user as a value that compares by content: a one-element
    tensor or numpy scalar becomes its number (tensors hash by identity, so equal tensor ids would
    be as many users as examples); NaN, which equals nothing, and other tensors are refused."""
    if isinstance(user, (torch.Tensor, np.ndarray, np.generic)):
        if (user.numel() if isinstance(user, torch.Tensor) else user.size) != 1:
            raise ValueError(f"user_ids[{index}] is a tensor of shape {tuple(user.shape)}: a user id must be one "
                             "number or string per example (pass a 1-D tensor, or a list of ints or strings)")
        user = user.item()
    if isinstance(user, float) and math.isnan(user):
        raise ValueError(f"user_ids[{index}] is NaN: NaN equals no other id, so each such example would be a user "
                         "of its own; give every example a real user id")
    return user


class UnitPoissonSampler(Sampler[List[int]]):
    """Batch sampler of Poisson samples of units (module doc).

    Args:
        units: the example indices of every unit (for example-level units, ``[[0], [1], ...]``).
        sample_rate: ``q``, the probability of each unit in each step.
        max_rows_per_unit: ``k``, the examples a sampled unit contributes at most.
        multiplicity: ``K``, the rows of each chosen example.
        unit_gradient: ``"mean"`` or ``"sum"`` of a unit's row gradients.
        distributed: shard the units over the ranks of ``torch.distributed`` (or ``num_replicas``/``rank``).
    """

    logs_draw_states = True  # log_state_after_draw: a loader drawing ahead knows each batch's state
    state_log = None

    def __init__(self, units: Sequence[Sequence[int]], *, sample_rate: float, max_rows_per_unit: Optional[int] = None,
                 multiplicity: int = 1, unit_gradient: str = "mean", generator=None, steps: Optional[int] = None,
                 distributed: bool = False, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle_seed: int = 0):
        if not units:
            raise ValueError("there are no privacy units to sample from (empty dataset)")
        if unit_gradient not in UNIT_GRADIENTS:
            raise ValueError(f"unit_gradient must be one of {UNIT_GRADIENTS}, got {unit_gradient!r}")
        self.units = [list(u) for u in units]
        self.sample_rate = check_sample_rate(sample_rate)
        self.max_rows_per_unit = None if max_rows_per_unit is None else \
            check_positive_int(max_rows_per_unit, "max_examples_per_user")
        self.multiplicity = check_positive_int(multiplicity, "augmentation_multiplicity")
        self.unit_gradient = unit_gradient
        self.generator = generator
        self.steps = default_steps(self.sample_rate) if steps is None else check_positive_int(steps, "steps")
        self.num_replicas, self.rank = distributed_world(num_replicas, rank) if distributed else (1, 0)
        self.distributed = bool(distributed)
        self.shuffle_seed, self.epoch = int(shuffle_seed), 0
        self.layouts: deque = deque()  # UnitGroups of each yielded batch, in order
        self._rows_of_ranks: List[List[int]] = []

    @property
    def num_units(self) -> int:
        return len(self.units)

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        """Use the unit-to-rank assignment of ``epoch`` on the next iteration."""
        self.epoch = int(epoch)

    def expected_batch_size(self) -> float:
        """Expected units per step on this rank, ``q · U / R``."""
        return self.sample_rate * self.num_units / self.num_replicas

    def owner_of_units(self) -> torch.Tensor:
        """The rank owning each unit this epoch (all zeros in one process)."""
        if self.num_replicas == 1:
            return torch.zeros(self.num_units, dtype=torch.long)
        order = torch.randperm(self.num_units, generator=torch.Generator().manual_seed(self.shuffle_seed + self.epoch))
        owner = torch.empty(self.num_units, dtype=torch.long)
        owner[order] = torch.arange(self.num_units) % self.num_replicas
        return owner

    def __iter__(self) -> Iterator[List[int]]:
        return self.draw(count_batches=True)

    def draw(self, *, count_batches: bool) -> Iterator[List[int]]:
        """The ``steps`` local batches of one pass (``count_batches``: see the distributed sampler)."""
        self.layouts.clear()
        owner = self.owner_of_units()
        if self.distributed:
            note_shard_assignment(self.shuffle_seed + self.epoch)
        for _ in range(self.steps):
            sampled = poisson_mask(self.num_units, self.sample_rate, self.generator).nonzero().view(-1).tolist()
            rows = [self._rows_of(u) for u in sampled]  # every rank draws every subset: one stream
            self._rows_of_ranks = [[len(r) for u, r in zip(sampled, rows) if owner[u] == rank]
                                   for rank in range(self.num_replicas)]
            log_state_after_draw(self)
            mine = [r for u, r in zip(sampled, rows) if owner[u] == self.rank]
            self.layouts.append(UnitGroups.from_sizes([len(r) for r in mine], self.unit_gradient))
            if count_batches and self.distributed:
                count_logical_batch()
            yield [i for r in mine for i in r]

    def _rows_of(self, unit: int) -> List[int]:
        """The rows of a sampled unit: at most ``k`` of its examples (a fresh uniform subset),
        each ``K`` times."""
        members = self.units[unit]
        k = self.max_rows_per_unit
        if k is not None and len(members) > k:
            chosen = torch.randperm(len(members), generator=self.generator)[:k].sort().values.tolist()
            members = [members[j] for j in chosen]
        return [i for i in members for _ in range(self.multiplicity)]

    def unit_sizes_of_ranks(self) -> List[List[int]]:
        """The rows of every sampled unit of every rank in the batch drawn last (each rank knows
        the others' without communicating: one shared stream)."""
        return [list(sizes) for sizes in self._rows_of_ranks]

    def batch_sizes_of_ranks(self) -> List[int]:
        """The local batch size of every rank in the batch drawn last."""
        return [sum(sizes) for sizes in self._rows_of_ranks]
