"""Parallel Gaussian noise, its draws: the keyed generators against independent oracles (MT19937
seeding by hand, SplitMix64's reference outputs, the chunks drawn one by one), determinism for any
number of threads, and seeded statistics (moments, Kolmogorov–Smirnov, correlation of neighbours,
of chunks, of steps and of streams), each with a check that the statistic can fail."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from opacus_dp.distributed.noise_streams import give_rank_its_stream
from opacus_dp.optim import keyed_generators as keyed
from opacus_dp.optim.chunked_draws import CHUNK_ELEMENTS, SMALL_ELEMENTS
from opacus_dp.optim.parallel_noise import SMALL_LANE, ParallelGaussianNoise

LARGE = 4 * CHUNK_ELEMENTS + 12_345  # five chunks, the last one partial
CPU = torch.device("cpu")


def first_step(noise, *shapes, std=1.0):
    noise.begin_step(CPU)
    return [noise.sample(torch.zeros(shape), std) for shape in shapes]


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.double().numpy().ravel(), b.double().numpy().ravel())[0, 1])


def test_writing_the_words_of_manual_seed_reproduces_torch_generator():
    """The serialised-state layout the parallel noise writes (checked at first use, named here)."""
    keyed.check_state_layout()
    for seed in (0, 1, 2**31 + 5, 2**32 - 1):
        expected = torch.randn(100, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(torch.randn(100, generator=keyed.generator_with_words(keyed.mt_seeding_words(seed))),
                           expected)
    words = keyed.mt_seeding_words(3).copy()
    words[400] ^= 1  # one bit of the state elsewhere: other draws (the words are really used)
    assert not torch.equal(torch.randn(2000, generator=keyed.generator_with_words(words)),
                           torch.randn(2000, generator=torch.Generator().manual_seed(3)))


def test_splitmix64_matches_its_reference_outputs():
    assert [keyed.splitmix64(0, i) for i in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                          0x06C45D188009454F]


def test_keys_differing_above_bit_32_give_other_draws():
    """torch's manual_seed keeps 32 bits (so a derived 64-bit seed would collide); the keys do not."""
    high = 1 << 40
    assert torch.equal(torch.randn(8, generator=torch.Generator().manual_seed(7)),
                       torch.randn(8, generator=torch.Generator().manual_seed(7 + high)))
    a, = first_step(ParallelGaussianNoise(seed=7), (LARGE,))
    b, = first_step(ParallelGaussianNoise(seed=7 + high), (LARGE,))
    assert abs(correlation(a, b)) < 5 / math.sqrt(LARGE)


def test_chunks_are_drawn_from_their_positions_generators():
    """Oracle: chunk j of tensor ``slot`` of step ``t`` drawn alone from the generator of (t, slot, j);
    tensors under SMALL_ELEMENTS from the step's one small generator, in call order."""
    key, shapes = 12345, [(LARGE,), (7,), (SMALL_ELEMENTS - 1,), (3, CHUNK_ELEMENTS)]
    noise = ParallelGaussianNoise(seed=key, num_threads=2)
    first_step(noise, *shapes, std=2.0)
    drawn = first_step(noise, *shapes, std=2.0)  # step 1
    small = keyed.cpu_generator(key, 1, 1, SMALL_LANE)
    for slot, (shape, tensor) in enumerate(zip(shapes, drawn)):
        n = math.prod(shape)
        if n < SMALL_ELEMENTS:
            expected = torch.normal(0.0, 2.0, size=(n,), generator=small)
        else:
            expected = torch.cat([torch.normal(0.0, 2.0, size=(min(CHUNK_ELEMENTS, n - start),),
                                               generator=keyed.cpu_generator(key, 1, slot, j))
                                  for j, start in enumerate(range(0, n, CHUNK_ELEMENTS))])
        assert torch.equal(tensor.reshape(-1), expected), shape


@pytest.mark.parametrize("secure", [False, True])
def test_draws_do_not_depend_on_the_number_of_threads(secure, monkeypatch):
    if secure:  # the same OS key for each run, to compare them
        monkeypatch.setattr("secrets.randbits", lambda bits: 0xC0FFEE)
    shapes = [(LARGE,), (5, 3), (2 * CHUNK_ELEMENTS,)]
    runs = []
    for threads in (1, 2, 3, 8):
        noise = ParallelGaussianNoise(secure_mode=secure, num_threads=threads) if secure else \
            ParallelGaussianNoise(seed=99, num_threads=threads)
        runs.append(first_step(noise, *shapes) + first_step(noise, *shapes))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_same_key_same_draws_other_key_other_draws():
    a = first_step(ParallelGaussianNoise(seed=5), (LARGE,), (10,))
    b = first_step(ParallelGaussianNoise(seed=5), (LARGE,), (10,))
    c = first_step(ParallelGaussianNoise(seed=6), (LARGE,), (10,))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("numel", [LARGE, 16 * CHUNK_ELEMENTS, 40_000])
def test_mean_and_std(secure, numel):
    """Seeded: |mean| < 5·s/√n and |std/s − 1| < 5/√(2n) (five standard errors); the small path
    (40 000 coordinates) is drawn over 25 tensors."""
    torch.manual_seed(0)  # the key of the non-secure noise
    noise, std = ParallelGaussianNoise(secure_mode=secure), 3.0
    count = 25 if numel < SMALL_ELEMENTS else 1
    x = torch.cat([t.reshape(-1) for t in first_step(noise, *[(numel,)] * count, std=std)]).double()
    n = x.numel()
    assert abs(float(x.mean())) < 5 * std / math.sqrt(n)
    assert abs(float(x.std()) / std - 1) < 5 / math.sqrt(2 * n)


def test_kolmogorov_smirnov_accepts_the_draws_and_rejects_a_wrong_scale():
    x, = first_step(ParallelGaussianNoise(seed=2024), (LARGE,), std=1.5)
    assert stats.kstest(x.double().numpy(), "norm", args=(0.0, 1.5)).pvalue > 1e-3
    assert stats.kstest(x.double().numpy(), "norm", args=(0.0, 1.5 * 1.01)).pvalue < 1e-6  # the test has power
    for j in range(5):  # every chunk alone, the partial last one included
        chunk = x[j * CHUNK_ELEMENTS:(j + 1) * CHUNK_ELEMENTS].double().numpy()
        assert stats.kstest(chunk, "norm", args=(0.0, 1.5)).pvalue > 1e-3, j


def test_neighbours_and_chunks_are_uncorrelated():
    x, = first_step(ParallelGaussianNoise(seed=31), (16 * CHUNK_ELEMENTS,))
    bound = 5 / math.sqrt(x.numel())
    for lag in (1, 2, 16, 17):  # neighbours (Box–Muller pairs, torch's blocks of 16 draws)
        assert abs(correlation(x[:-lag], x[lag:])) < bound, lag
    chunks = x.reshape(16, CHUNK_ELEMENTS).double()
    pairs = torch.corrcoef(chunks)[~torch.eye(16, dtype=torch.bool)]
    assert float(pairs.abs().max()) < 5 / math.sqrt(CHUNK_ELEMENTS)
    # across the boundaries: the 1024 coordinates before each boundary against the 1024 after it
    before = torch.cat([x[j * CHUNK_ELEMENTS - 1024:j * CHUNK_ELEMENTS] for j in range(1, 16)])
    after = torch.cat([x[j * CHUNK_ELEMENTS:j * CHUNK_ELEMENTS + 1024] for j in range(1, 16)])
    assert abs(correlation(before, after)) < 5 / math.sqrt(before.numel())
    assert abs(correlation(before, after.flip(0))) < 5 / math.sqrt(before.numel())
    repeated = torch.cat([chunks[0], chunks[0]])  # the check can fail: a chunk drawn twice
    assert correlation(repeated[:CHUNK_ELEMENTS], repeated[CHUNK_ELEMENTS:]) > 0.99


def test_steps_and_rank_streams_are_uncorrelated():
    noise = ParallelGaussianNoise(seed=8)
    steps = [first_step(noise, (LARGE,), (300,)) for _ in range(3)]
    for a, b in zip(steps, steps[1:]):
        assert abs(correlation(a[0], b[0])) < 5 / math.sqrt(LARGE)
        assert not torch.equal(a[1], b[1])
    ranks = []
    for rank in range(3):
        noise = ParallelGaussianNoise(seed=8)  # every rank seeded alike, as a training script does
        give_rank_its_stream(noise, rank)
        ranks.append(first_step(noise, (LARGE,))[0])
    for i in range(3):
        for j in range(i + 1, 3):
            assert abs(correlation(ranks[i], ranks[j])) < 5 / math.sqrt(LARGE), (i, j)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes(dtype):
    noise = ParallelGaussianNoise(seed=4, num_threads=2)
    noise.begin_step(CPU)
    x = noise.sample(torch.zeros(LARGE, dtype=dtype), 2.0)
    assert x.dtype == dtype and abs(float(x.double().std()) / 2.0 - 1) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_are_keyed_and_gaussian():
    device = torch.device("cuda")

    def draw(seed):
        noise = ParallelGaussianNoise(seed=seed)
        noise.begin_step(device)
        return [noise.sample(torch.zeros(LARGE, device=device), 2.0) for _ in range(2)]

    a, b, c = draw(1), draw(1), draw(1 + (1 << 40))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], c[0])
    assert abs(float(a[0].double().std()) / 2.0 - 1) < 5 / math.sqrt(2 * LARGE)
