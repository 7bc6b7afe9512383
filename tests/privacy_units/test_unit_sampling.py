"""The user-level sampler: Poisson over users at rate q, at most k examples of a sampled user (a
uniform subset), users never split across ranks, the union of the ranks' batches one global sample.
Statistical checks state their tolerance (binomial standard deviations)."""

import math
from collections import Counter

import pytest
import torch

from opacus_dp.data.unit_sampling import UnitPoissonSampler, units_of
from opacus_dp.maths.unit_groups import UnitGroups

USERS = [[0, 1, 2, 3, 4, 5, 6], [7], [8, 9], [10, 11, 12, 13]]  # n_u = 7, 1, 2, 4


def _sampler(k=3, q=0.3, seed=0, steps=4000, **kwargs):
    return UnitPoissonSampler(USERS, sample_rate=q, max_rows_per_unit=k, generator=torch.Generator().manual_seed(seed),
                              steps=steps, **kwargs)


def _user_of():
    return {i: u for u, members in enumerate(USERS) for i in members}


def test_no_user_contributes_more_than_k_examples_to_a_step():
    """Counting: in every batch each user has ≤ k rows, all distinct examples of that user, consecutive."""
    user_of, k = _user_of(), 3
    sampler = _sampler(k=k, steps=2000)
    for batch in sampler:
        layout = sampler.layouts.popleft()
        users = [user_of[i] for i in batch]
        assert all(n <= k for n in Counter(users).values())
        assert len(set(batch)) == len(batch)
        runs = [users[0]] + [b for a, b in zip(users, users[1:]) if a != b] if users else []
        assert len(runs) == len(set(runs)) == layout.num_units  # a user's rows are consecutive
        assert layout.sizes() == [Counter(users)[u] for u in runs]


def test_users_are_sampled_at_rate_q_and_subsets_are_uniform():
    """P(user in batch) = q; P(example of user u in batch) = q·min(1, k/n_u). 5σ binomial bounds."""
    q, k, steps = 0.3, 3, 4000
    seen_users, seen_examples = Counter(), Counter()
    user_of = _user_of()
    for batch in _sampler(k=k, q=q, steps=steps):
        seen_users.update({user_of[i] for i in batch})
        seen_examples.update(batch)
    for u, members in enumerate(USERS):
        assert abs(seen_users[u] - q * steps) < 5 * math.sqrt(steps * q * (1 - q))
        p = q * min(1.0, k / len(members))
        for i in members:
            assert abs(seen_examples[i] - p * steps) < 5 * math.sqrt(steps * p * (1 - p))


def test_ranks_hold_disjoint_users_whose_union_is_the_global_sample():
    one = list(_sampler(steps=50))
    ranks = [list(_sampler(steps=50, distributed=True, num_replicas=2, rank=r)) for r in range(2)]
    user_of = _user_of()
    owners = {}
    for r, batches in enumerate(ranks):
        for batch in batches:
            for i in batch:
                assert owners.setdefault(user_of[i], r) == r  # a user stays on one rank
    for step in range(50):
        assert sorted(ranks[0][step] + ranks[1][step]) == sorted(one[step])
    assert set(owners.values()) == {0, 1}


def test_augmentation_multiplicity_repeats_each_chosen_example():
    sampler = UnitPoissonSampler([[i] for i in range(10)], sample_rate=0.5, multiplicity=3,
                                 generator=torch.Generator().manual_seed(1), steps=5)
    for batch in sampler:
        assert batch == [i for i in batch[::3] for _ in range(3)]
        assert sampler.layouts.popleft().sizes() == [3] * (len(batch) // 3)


def test_units_of_groups_examples_by_user():
    assert units_of(["b", "a", "b", "c"], 4) == [[1], [0, 2], [3]]
    assert units_of(torch.tensor([5, 5, 2]), 3) == [[2], [0, 1]]
    with pytest.raises(ValueError, match="user_ids has 2 entries but the dataset has 3"):
        units_of([1, 2], 3)
    with pytest.raises(ValueError, match="None"):
        units_of([1, None, 2], 3)


def test_unit_groups_maths_by_hand():
    groups = UnitGroups.from_sizes([2, 1], "mean")
    g = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0]])
    torch.testing.assert_close(groups.unit_sums(g), torch.tensor([[2.0, 2.0], [0.0, 2.0]]))
    torch.testing.assert_close(groups.sq_norms(g), torch.tensor([8.0, 4.0]))
    torch.testing.assert_close(groups.row_factors(torch.tensor([0.5, 1.0], dtype=torch.float64)),
                               torch.tensor([0.25, 0.25, 1.0], dtype=torch.float64))
    summed = UnitGroups.from_sizes([2, 1], "sum")
    torch.testing.assert_close(summed.sq_norms(g), torch.tensor([32.0, 4.0]))
    both = UnitGroups.concat([groups, summed])
    assert both.num_units == 4 and both.index.tolist() == [0, 0, 1, 2, 2, 3]


def test_worker_processes_keep_each_batch_with_its_grouping():
    """With 2 loader workers (prefetching) every delivered grouping is that of its batch: the same
    batches and groupings as without workers, under the same seed."""
    import warnings

    from torch.utils.data import DataLoader

    from opacus_dp import PrivacyEngine
    from tests.privacy_units.models import make_data, make_model, stepped_batches

    def run(workers: int):
        dataset, users = make_data("mlp")
        model = make_model("mlp")
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private, optimizer, loader = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(dataset, batch_size=6, num_workers=workers), noise_multiplier=1.0,
                max_grad_norm=1.0, privacy_unit="user", user_ids=users, max_examples_per_user=3)
            return stepped_batches(private, optimizer, loader, lambda x: (x.clone(), loader.unit_channel.latest().sizes()))

    alone, with_workers = run(0), run(2)
    assert len(alone) == len(with_workers) == 6
    for (x, sizes), (x_w, sizes_w) in zip(alone, with_workers):
        assert torch.equal(x, x_w) and sizes == sizes_w and sum(sizes) == x.shape[0]
