"""Poisson batch samplers: statistics of the draws, lengths, reproducibility, sharding across ranks.

Statistical tolerances are stated next to each check (multiples of the standard deviation of the
estimated quantity under the Poisson model), so the tests fail if sampling is not Poisson.
"""

import math

import pytest
import torch

from opacus_dp.data import (
    DistributedPoissonBatchSampler,
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from opacus_dp.utils.uniform_sampler import UniformWithReplacementSampler as CompatSampler


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def inclusion_matrix(batches, num_samples: int) -> torch.Tensor:
    """(steps, N) 0/1 matrix: entry (t, i) = 1 iff example i is in batch t."""
    m = torch.zeros(len(batches), num_samples, dtype=torch.float64)
    for t, batch in enumerate(batches):
        m[t, batch] = 1.0
    return m


def draws(**kwargs):
    """Every draw of a sampler, empty ones included (``skip_empty=False``)."""
    return list(UniformWithReplacementSampler(skip_empty=False, **kwargs))


def test_batch_size_mean_and_variance_match_binomial():
    n, q, steps = 200, 0.1, 400
    batches = draws(num_samples=n, sample_rate=q, generator=seeded(1), steps=steps)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    # mean of 400 Binomial(200, 0.1) draws: sd = sqrt(18/400) ≈ 0.21 -> 5 sd tolerance
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    # sample variance: relative sd ≈ sqrt(2/399) ≈ 0.07 -> 25% tolerance (≈ 3.5 sd)
    assert abs(sizes.var().item() / (n * q * (1 - q)) - 1) < 0.25


def test_every_example_has_rate_q_and_draws_are_independent():
    n, q, steps = 200, 0.1, 400
    m = inclusion_matrix(
        draws(num_samples=n, sample_rate=q, generator=seeded(2), steps=steps), n
    )
    counts = m.sum(0)
    # Pearson statistic over N examples ~ chi2(N): mean N, sd sqrt(2N) = 20 -> 5 sd tolerance
    chi2 = ((counts - steps * q) ** 2 / (steps * q * (1 - q))).sum().item()
    assert abs(chi2 - n) < 5 * math.sqrt(2 * n)
    # indices are distinct within a batch
    assert m.max() == 1
    # independence across steps: lag-1 correlation of each example's indicators, averaged over
    # examples; sd ≈ 1/sqrt(N·steps) ≈ 0.0035 -> tolerance 0.02
    centred = m - q
    lag1 = (centred[1:] * centred[:-1]).mean().item() / (q * (1 - q))
    assert abs(lag1) < 0.02
    # independence across examples: mean pairwise correlation within a step; under independence
    # its sd is ≈ sqrt(2)/((N-1)·sqrt(steps)) ≈ 0.00036 -> 5 sd. Fixed-size batches give -1/(N-1).
    pair_sum = (centred.sum(1) ** 2 - (centred**2).sum(1)).mean().item()
    mean_pair_corr = pair_sum / (n * (n - 1) * q * (1 - q))
    assert abs(mean_pair_corr) < 5 * math.sqrt(2) / ((n - 1) * math.sqrt(steps))


def test_empty_batches_occur_at_rate_one_minus_q_to_the_n():
    n, q, steps = 5, 0.05, 2000
    batches = draws(num_samples=n, sample_rate=q, generator=seeded(3), steps=steps)
    p_empty = (1 - q) ** n
    empty = sum(len(b) == 0 for b in batches) / steps
    assert abs(empty - p_empty) < 5 * math.sqrt(p_empty * (1 - p_empty) / steps)
    assert all(isinstance(b, list) and all(isinstance(i, int) for i in b) for b in batches)


@pytest.mark.parametrize("q, expected_len", [(0.3, 3), (1 / 7, 7), (0.5, 2), (1.0, 1), (0.001, 1000)])
def test_default_length_is_round_of_inverse_rate(q, expected_len):
    sampler = UniformWithReplacementSampler(num_samples=10, sample_rate=q, skip_empty=False)
    assert len(sampler) == expected_len
    assert len(list(sampler)) == expected_len


def test_steps_and_positional_form():
    g = seeded(4)
    sampler = CompatSampler(10, 0.5, g)
    assert sampler is not None and sampler.generator is g and len(sampler) == 2
    assert len(draws(num_samples=10, sample_rate=0.5, steps=9)) == 9


def test_rate_one_takes_everything():
    batches = list(UniformWithReplacementSampler(num_samples=7, sample_rate=1.0, steps=3))
    assert batches == [list(range(7))] * 3


@pytest.mark.parametrize("q", [1e-9, 3e-8, 1e-7, 1.5 * 2.0 ** -24, 0.25, 1 / 3])
def test_inclusion_probability_of_the_uniform_grid_never_exceeds_q(q, monkeypatch):
    """Hand computation over the uniform grid: torch's float64 uniforms are k·2⁻⁵³ for k
    uniform in [0, 2⁵³), so the inclusion probability is (number of included k) / 2⁵³. The
    included k form a prefix; the test feeds the grid points around its end and checks that
    the count is at most q·2⁵³ and at least q·2⁵³ - 1 (float32 uniforms, multiples of 2⁻²⁴,
    gave ⌈q·2²⁴⌉/2²⁴: 60 q at q = 1e-9)."""
    from opacus_dp.data import samplers

    scale = 2.0 ** 53
    centre = math.floor(q * scale)
    ks = torch.arange(centre - 3, centre + 4, dtype=torch.float64)
    requested = []

    def grid(n, generator=None, dtype=None):
        requested.append(dtype)
        return ks / scale

    monkeypatch.setattr(samplers.torch, "rand", grid)
    included = ks[samplers.poisson_mask(len(ks), q, None)]
    assert requested == [torch.float64]
    assert len(included) and len(included) < len(ks), "the end of the prefix must be in the window"
    assert torch.all(included == ks[: len(included)]), "included grid points form a prefix"
    count = float(included.max()) + 1  # grid points 0 .. max are included
    assert q * scale - 1 <= count <= q * scale


def test_generator_state_is_checkpointable():
    sampler = UniformWithReplacementSampler(num_samples=50, sample_rate=0.2, generator=seeded(5), steps=6,
                                            skip_empty=False)
    it = iter(sampler)
    [next(it) for _ in range(2)]
    state = sampler.generator.get_state()
    rest = list(it)
    sampler.generator.set_state(state)
    assert list(sampler)[:4] == rest


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=10, sample_rate=0.0), "sample_rate"),
        (dict(num_samples=10, sample_rate=1.5), "sample_rate"),
        (dict(num_samples=0, sample_rate=0.5), "num_samples"),
        (dict(num_samples=10, sample_rate=0.5, steps=0), "steps"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UniformWithReplacementSampler(**kwargs)


def test_bad_argument_types_are_named():
    with pytest.raises(TypeError, match="sample_rate"):
        UniformWithReplacementSampler(num_samples=10, sample_rate="0.5")
    with pytest.raises(TypeError, match="num_samples"):
        UniformWithReplacementSampler(num_samples=10.0, sample_rate=0.5)


# ---------------------------------------------------------------- distributed


def rank_samplers(total, q, replicas, seeds, **kwargs):
    return [
        DistributedPoissonBatchSampler(
            total_size=total, sample_rate=q, num_replicas=replicas, rank=r, generator=seeded(seeds[r]), **kwargs
        )
        for r in range(replicas)
    ]


def test_distributed_shards_partition_the_dataset():
    samplers = rank_samplers(50, 0.2, 3, [0, 0, 0])
    shards = [s.shard_indices().tolist() for s in samplers]
    assert sorted(sum(shards, [])) == list(range(50))
    assert [len(s) for s in shards] == [17, 17, 16] == [s.num_samples for s in samplers]


def test_distributed_shared_seed_union_is_one_disjoint_poisson_batch():
    total, q, replicas, steps = 60, 0.2, 3, 300
    samplers = rank_samplers(total, q, replicas, [7, 7, 7], steps=steps)
    per_rank = [list(s) for s in samplers]
    assert all(len(batches) == steps for batches in per_rank)
    unions = []
    for t in range(steps):
        locals_t = [per_rank[r][t] for r in range(replicas)]
        for r, batch in enumerate(locals_t):
            assert set(batch) <= set(samplers[r].shard_indices().tolist())
        union = sum(locals_t, [])
        assert len(union) == len(set(union))  # disjoint
        unions.append(union)
    m = inclusion_matrix(unions, total)
    # each example in the global batch w.p. q: pooled rate sd = sqrt(q(1-q)/(N·steps)) ≈ 0.0067
    assert abs(m.mean().item() - q) < 5 * math.sqrt(q * (1 - q) / (total * steps))
    sizes = m.sum(1)
    assert abs(sizes.var().item() / (total * q * (1 - q)) - 1) < 0.3


def test_distributed_independent_seeds_keep_rate_q_per_example():
    total, q, replicas, steps = 40, 0.25, 2, 400
    samplers = rank_samplers(total, q, replicas, [1, 2], steps=steps)
    per_rank = [list(s) for s in samplers]
    unions = [per_rank[0][t] + per_rank[1][t] for t in range(steps)]
    m = inclusion_matrix(unions, total)
    counts = m.sum(0)
    chi2 = ((counts - steps * q) ** 2 / (steps * q * (1 - q))).sum().item()
    assert abs(chi2 - total) < 5 * math.sqrt(2 * total)


def test_distributed_ranks_yield_same_number_of_batches_even_when_empty():
    # shard of 1-2 examples at q = 0.05: most local batches are empty, but every rank yields all steps
    samplers = rank_samplers(5, 0.05, 4, [0, 1, 2, 3], steps=50)
    lengths = [len(list(s)) for s in samplers]
    assert lengths == [50] * 4 == [len(s) for s in samplers]
    assert any(len(b) == 0 for b in list(samplers[0]))


def test_distributed_set_epoch_reshuffles_shards():
    sampler = DistributedPoissonBatchSampler(total_size=30, sample_rate=0.5, num_replicas=2, rank=0)
    epoch0 = sampler.shard_indices().tolist()
    sampler.set_epoch(0)
    assert sampler.shard_indices().tolist() == epoch0
    sampler.set_epoch(1)
    epoch1 = sampler.shard_indices().tolist()
    assert epoch1 != epoch0 and len(epoch1) == len(epoch0)
    unshuffled = DistributedPoissonBatchSampler(total_size=30, sample_rate=0.5, num_replicas=2, rank=1, shuffle=False)
    assert unshuffled.shard_indices().tolist() == list(range(1, 30, 2))


def test_distributed_default_length_and_alias():
    sampler = DistributedUniformWithReplacementSampler(total_size=10, sample_rate=0.25, num_replicas=2, rank=1)
    assert len(sampler) == sampler.num_batches == 4
    assert DistributedUniformWithReplacementSampler is DistributedPoissonBatchSampler


def test_distributed_needs_world_information():
    with pytest.raises(ValueError, match="num_replicas and rank"):
        DistributedPoissonBatchSampler(total_size=10, sample_rate=0.5)
    with pytest.raises(ValueError, match="rank"):
        DistributedPoissonBatchSampler(total_size=10, sample_rate=0.5, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="total_size"):
        DistributedPoissonBatchSampler(total_size=0, sample_rate=0.5, num_replicas=2, rank=0)
