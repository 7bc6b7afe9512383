"""DPDataLoader: Poisson batches, empty batches with the right structure, construction from a loader."""

import collections
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from opacus_dp.data import DPDataLoader, SamplingWarning, UniformWithReplacementSampler, switch_generator
from opacus_dp.data.collate import EmptyBatchCollate, empty_like_batch
from opacus_dp.data_loader import DPDataLoader as CompatDPDataLoader

Pair = collections.namedtuple("Pair", ["x", "y"])


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class DictDataset(Dataset):
    """Examples are dicts with a float64 vector, an int label, a Python float and a string."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((5,), float(i), dtype=torch.float64), "y": i % 3, "w": 0.5 * i, "name": f"s{i}"}


class NamedTupleDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Pair(torch.full((2, 3), float(i)), torch.tensor(i, dtype=torch.int32))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def tensor_dataset(n=12):
    x = torch.randn(n, 3, 4)
    y = torch.randint(0, 5, (n,))
    mask = torch.rand(n, 2) > 0.5
    return TensorDataset(x, y, mask)


def batches_with_empties(loader, min_empty=1):
    batches = list(loader)
    assert sum(len(b[0]) == 0 if not isinstance(b, dict) else len(b["x"]) == 0 for b in batches) >= min_empty
    return batches


def test_tensor_dataset_empty_batches_keep_trailing_shape_and_dtype():
    ds = tensor_dataset(3)
    loader = DPDataLoader(ds, sample_rate=0.05, generator=seeded(0), steps=40)  # P(empty) ≈ 0.86
    for x, y, mask in batches_with_empties(loader):
        assert x.shape[1:] == (3, 4) and x.dtype == torch.float32
        assert y.dim() == 1 and y.dtype == torch.int64
        assert mask.shape[1:] == (2,) and mask.dtype == torch.bool
        assert len(x) == len(y) == len(mask)


def test_dict_dataset_empty_batches():
    loader = DPDataLoader(DictDataset(2), sample_rate=0.05, generator=seeded(1), steps=40)
    empties = [b for b in batches_with_empties(loader) if len(b["x"]) == 0]
    for batch in empties:
        assert set(batch) == {"x", "y", "w", "name"}
        assert batch["x"].shape == (0, 5) and batch["x"].dtype == torch.float64
        assert batch["y"].shape == (0,) and batch["y"].dtype == torch.int64
        assert batch["w"].shape == (0,) and batch["w"].dtype == torch.float64
        assert batch["name"] == []


def test_named_tuple_dataset_empty_batches():
    loader = DPDataLoader(NamedTupleDataset(), sample_rate=0.01, generator=seeded(2), steps=20)
    empty = next(b for b in loader if len(b.x) == 0)
    assert isinstance(empty, Pair)
    assert empty.x.shape == (0, 2, 3) and empty.y.shape == (0,) and empty.y.dtype == torch.int32


def test_empty_batch_does_not_carry_values_and_is_fresh():
    collate = EmptyBatchCollate.from_dataset(tensor_dataset(4), None)
    first, second = collate([]), collate([])
    assert first[0].numel() == 0 and first[0] is not second[0]


def test_time_major_empty_batch():
    empty = empty_like_batch([torch.zeros(7, 1, 4), torch.zeros(1)], batch_first=False)
    assert empty[0].shape == (7, 0, 4) and empty[1].shape == (0,)


class SequenceDataset(Dataset):
    """Examples ``(T, F)`` sequences of the example's own length, multi-hot labels ``(K,)``."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.full((i + 2, 3), float(i)), (torch.arange(4) % (i + 1) == 0).float()


def time_major_collate(rows):
    """Sequence-first inputs ``(T, B, F)`` (equal lengths), batch-first labels ``(B, K)``."""
    return torch.stack([x[:2] for x, _ in rows], dim=1), torch.stack([y for _, y in rows])


def list_collate(rows):
    """A per-example list of variable-length sequences (the model pads), labels ``(B, K)``."""
    return [x for x, _ in rows], torch.stack([y for _, y in rows])


def test_empty_batch_empties_the_dimension_that_holds_the_examples():
    """Learned from the collates of one and two examples: the sequence-first input loses its
    dim 1, the batch-first labels of the same (sequence-first) loader their dim 0."""
    loader = DPDataLoader(SequenceDataset(), sample_rate=0.3, collate_fn=time_major_collate,
                          batch_first=False)
    x, y = loader.collate_fn([])
    assert x.shape == (2, 0, 3) and y.shape == (0, 4)
    full_x, full_y = loader.collate_fn([SequenceDataset()[1], SequenceDataset()[2], SequenceDataset()[3]])
    assert full_x.shape == (2, 3, 3) and full_y.shape == (3, 4)


def test_empty_batch_of_a_per_example_list_is_an_empty_list():
    loader = DPDataLoader(SequenceDataset(), sample_rate=0.3, collate_fn=list_collate)
    sequences, labels = loader.collate_fn([])
    assert sequences == [] and labels.shape == (0, 4)


def test_numpy_fields_and_unsupported_fields():
    assert empty_like_batch({"a": np.ones((1, 3), dtype=np.int16)})["a"].shape == (0, 3)
    with pytest.raises(TypeError, match=r"batch\['meta'\]"):
        empty_like_batch({"meta": object()})
    with pytest.raises(TypeError, match="0-dim"):
        DPDataLoader(tensor_dataset(), sample_rate=0.5, collate_fn=lambda b: torch.tensor(float(len(b))))


def test_non_empty_batches_are_the_sampled_examples():
    ds = tensor_dataset(20)
    loader = DPDataLoader(ds, sample_rate=0.3, generator=seeded(3), steps=5)
    # oracle: the same generator state drives the Poisson batch sampler alone (iterating the
    # loader draws its workers' base seed from a generator of its own)
    oracle_generator = seeded(3)
    oracle_sampler = UniformWithReplacementSampler(num_samples=20, sample_rate=0.3, generator=oracle_generator, steps=5,
                                                   skip_empty=False)
    oracle_indices = list(oracle_sampler)
    for (x, y, mask), indices in zip(loader, oracle_indices):
        expected = default_collate([ds[i] for i in indices]) if indices else None
        if expected is None:
            assert len(x) == 0
            continue
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1]) and torch.equal(mask, expected[2])


def test_loader_exposes_rate_generator_distributed_and_length():
    g = seeded(4)
    loader = CompatDPDataLoader(tensor_dataset(), sample_rate=0.25, generator=g)
    assert loader.sample_rate == 0.25 and loader.generator is g and loader.distributed is False
    assert len(loader) == 4 and len(list(loader)) == 4


def test_default_generator_is_seeded_from_global_rng_and_checkpointable():
    ds = TensorDataset(torch.arange(30))

    def indices_after_seed(seed):
        torch.manual_seed(seed)
        return [b[0].tolist() for b in DPDataLoader(ds, sample_rate=0.2)]

    assert indices_after_seed(123) == indices_after_seed(123) != indices_after_seed(124)
    loader = DPDataLoader(ds, sample_rate=0.2)
    assert isinstance(loader.generator, torch.Generator)
    state = loader.generator.get_state()
    run_a = [b[0].tolist() for b in loader]
    loader.generator.set_state(state)
    assert [b[0].tolist() for b in loader] == run_a


def test_drop_last_is_ignored_with_warning():
    with pytest.warns(UserWarning, match="drop_last"):
        loader = DPDataLoader(tensor_dataset(), sample_rate=0.5, drop_last=True)
    assert len(loader) == 2


def test_from_data_loader_takes_settings():
    ds = tensor_dataset(10)
    g = seeded(5)
    collate = lambda batch: default_collate(batch)  # noqa: E731
    source = DataLoader(ds, batch_size=3, collate_fn=collate, generator=g, shuffle=True)
    loader = DPDataLoader.from_data_loader(source)
    assert loader.sample_rate == pytest.approx(1 / 4) and len(loader) == 4
    assert loader.generator is g and loader.dataset is ds
    assert loader.collate_fn.collate_fn is collate
    other = seeded(6)
    assert DPDataLoader.from_data_loader(source, generator=other).generator is other


def test_from_dp_data_loader_keeps_rate_and_does_not_double_wrap():
    source = DPDataLoader(tensor_dataset(10), sample_rate=0.3)
    again = DPDataLoader.from_data_loader(source)
    assert again.sample_rate == 0.3
    assert not isinstance(again.collate_fn.collate_fn, EmptyBatchCollate)


def test_from_data_loader_rejects_unusable_loaders():
    with pytest.raises(ValueError, match="IterableDataset"):
        DPDataLoader.from_data_loader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(ValueError, match="batch_size=None"):
        DPDataLoader.from_data_loader(DataLoader(tensor_dataset(), batch_size=None))
    with pytest.raises(TypeError, match="DataLoader"):
        DPDataLoader.from_data_loader([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        DPDataLoader(TensorDataset(torch.zeros(0, 2)), sample_rate=0.5)


def test_worker_processes_handle_empty_batches():
    loader = DPDataLoader(tensor_dataset(3), sample_rate=0.1, generator=seeded(7), steps=12, num_workers=1)
    batches = batches_with_empties(loader)
    assert len(batches) == 12 and all(b[0].shape[1:] == (3, 4) for b in batches)


def test_switch_generator_for_dp_loader():
    ds = TensorDataset(torch.arange(20))
    loader = DPDataLoader(ds, sample_rate=0.25, generator=seeded(8))
    switched = switch_generator(data_loader=loader, generator=seeded(9))
    reference = DPDataLoader(ds, sample_rate=0.25, generator=seeded(9))
    assert isinstance(switched, DPDataLoader) and switched.sample_rate == 0.25
    got, expected = [b[0].tolist() for b in switched], [b[0].tolist() for b in reference]
    assert got == expected and got != [b[0].tolist() for b in loader]
    assert loader.generator.initial_seed() == 8


def test_switch_generator_for_shuffled_loader_copies_sampler():
    ds = tensor_dataset(10)
    source = DataLoader(ds, batch_size=5, shuffle=True, generator=seeded(10))
    g = seeded(11)
    switched = switch_generator(data_loader=source, generator=g)
    assert switched.batch_sampler.sampler.generator is g
    assert source.batch_sampler.sampler.generator is not g
    with pytest.raises(ValueError, match="generator"):
        switch_generator(data_loader=DataLoader(ds, batch_size=5), generator=g)


def test_distributed_loader_in_single_process_group():
    import torch.distributed as dist

    from tests.conftest import free_port

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        loader = DPDataLoader(tensor_dataset(8), sample_rate=0.5, generator=seeded(12), distributed=True)
        assert loader.distributed and loader.batch_sampler.num_replicas == 1
        assert len(list(loader)) == 2
    finally:
        dist.destroy_process_group()


def _indices(loader, count):
    """The first ``count`` batches of ``loader`` as index lists (new iterators as needed)."""
    out = []
    while len(out) < count:
        for (x,) in loader:
            out.append(x.long().tolist())
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("num_workers, split", [(0, 1), (0, 3), (0, 4), (2, 4)])
def test_resuming_from_a_saved_sampling_state_mid_epoch_draws_the_same_batches(split, num_workers):
    """A run stopped after ``split`` batches (mid-epoch for 1 and 3 of the 4 steps per pass),
    resumed in a new loader from the saved ``loader.generator`` state, draws exactly the
    batches of the uninterrupted run: creating an iterator must not draw from the sampling
    generator (a DataLoader takes its worker base seed from ``loader.generator``). With worker
    processes the loader samples batches ahead (prefetching), so only epoch boundaries are
    exact there."""
    data = TensorDataset(torch.arange(20).float())
    make = lambda seed: DPDataLoader(data, sample_rate=0.25, generator=seeded(seed),  # noqa: E731
                                     num_workers=num_workers)
    reference = _indices(make(0), 8)
    first_loader = make(0)
    first = _indices(first_loader, split)
    resumed_loader = make(123)
    resumed_loader.generator.set_state(first_loader.generator.get_state())
    assert first + _indices(resumed_loader, 8 - split) == reference


# ------------------------------------------------------- loaders make_private cannot take as they are
def _make_private(loader, **kwargs):
    from opacus_dp import PrivacyEngine

    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(secure_mode=kwargs.pop("secure_mode", False))
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)


def rows(n=20):
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


@pytest.mark.parametrize("sampler, match", [
    (lambda: torch.utils.data.SubsetRandomSampler(range(16)), r"SubsetRandomSampler draws from a subset.*Subset\("),
    (lambda: torch.utils.data.WeightedRandomSampler([1.0] * 20, 20), r"WeightedRandomSampler weights the examples"),
])
def test_poisson_sampling_refuses_to_drop_a_subset_or_weighted_sampler(sampler, match):
    """Poisson sampling draws from the whole dataset at one rate: silently replacing these
    samplers trained on held-out examples (all 20 instead of 16) or dropped the weights."""
    with pytest.raises(ValueError, match=match):
        _make_private(DataLoader(rows(), batch_size=4, sampler=sampler()))


def test_custom_sampler_replaced_by_poisson_sampling_is_announced_and_standard_ones_are_not():
    class EveryOther(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(0, 20, 2))

        def __len__(self):
            return 10

    with pytest.warns(UserWarning, match=r"EveryOther is replaced by Poisson sampling over the whole dataset \(20"):
        _make_private(DataLoader(rows(), batch_size=4, sampler=EveryOther()))
    shard = torch.utils.data.distributed.DistributedSampler(rows(), num_replicas=1, rank=0)
    for loader in (DataLoader(rows(), batch_size=4, shuffle=True), DataLoader(rows(), batch_size=4, sampler=shard)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            DPDataLoader.from_data_loader(loader)


@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_loaders_without_batches_or_length_are_refused(poisson_sampling):
    """batch_size=None: an example's rows would be clipped as separate examples (5× the
    sensitivity the noise covers for (5, F) examples without Poisson sampling)."""
    class NoLength(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

    with pytest.raises(ValueError, match=r"automatic batching disabled \(batch_size=None\)"):
        _make_private(DataLoader(rows(), batch_size=None), poisson_sampling=poisson_sampling)
    with pytest.raises(ValueError, match=r"batch sampler NoLength has no len\(\)"):
        _make_private(DataLoader(rows(), batch_sampler=NoLength()), poisson_sampling=poisson_sampling)


def test_secure_mode_with_a_sequential_loader_names_the_way_out():
    with pytest.raises(ValueError, match=r"secure_mode=True.*SequentialSampler.*poisson_sampling=True"):
        with pytest.warns(SamplingWarning, match="fixed-size batches"):
            _make_private(DataLoader(rows(), batch_size=4), poisson_sampling=False, secure_mode=True)


def test_constant_metadata_lists_of_a_collate_are_emptied():
    """A collate that adds constant strings (class names) to every batch: the empty batch has
    an empty list there (as for per-example names), not a refusal."""
    def collate(items):
        return {"x": torch.stack([i[0] for i in items]), "classes": ["neg", "pos"], "task": ["cls"]}

    loader = DPDataLoader(rows(), sample_rate=0.2, collate_fn=collate)
    empty = loader.collate_fn([])
    assert empty["x"].shape == (0, 4) and empty["classes"] == [] and empty["task"] == []


def test_a_distributed_sampler_is_uniform_for_the_sampling_check():
    from opacus_dp.data import check_sampling

    shard = torch.utils.data.distributed.DistributedSampler(rows(), num_replicas=2, rank=0)
    with pytest.warns(UserWarning) as caught:
        check_sampling(DataLoader(rows(), batch_size=4, sampler=shard), poisson_expected=False)
    assert not any("not uniform" in str(w.message) for w in caught)
    assert any("fixed-size batches" in str(w.message) for w in caught)
