"""check_sampling warns for every loader that is not Poisson-sampled, and only for those."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from opacus_dp.data import BatchMemoryManager, DPDataLoader, SamplingWarning, check_sampling, is_poisson_loader


class RecordingOptimizer:
    def signal_skip_step(self, do_skip=True):
        pass


def dataset(n=10):
    return TensorDataset(torch.randn(n, 2))


def messages(loader, poisson_expected=True):
    with pytest.warns(SamplingWarning) as record:
        returned = check_sampling(loader, poisson_expected)
    assert [str(w.message) for w in record] == returned
    return " | ".join(returned)


def test_poisson_loaders_are_silent():
    loader = DPDataLoader(dataset(), sample_rate=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_sampling(loader) == [] and check_sampling(loader, poisson_expected=False) == []
        manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=RecordingOptimizer())
        with manager as physical:
            assert check_sampling(physical) == [] and is_poisson_loader(physical)
    assert is_poisson_loader(loader)


def test_shuffled_fixed_size_loader_warns():
    text = messages(DataLoader(dataset(), batch_size=4, shuffle=True))
    assert "fixed-size" in text and "Poisson sampling was requested" in text
    text = messages(DataLoader(dataset(), batch_size=4, shuffle=True), poisson_expected=False)
    assert "the accountant assumes Poisson sampling" in text
    assert not is_poisson_loader(DataLoader(dataset(), batch_size=4))


def test_drop_last_warns():
    assert "drop_last" in messages(DataLoader(dataset(), batch_size=4, shuffle=True, drop_last=True))


def test_weighted_sampler_warns():
    sampler = WeightedRandomSampler(torch.ones(10), num_samples=10)
    assert "not uniform" in messages(DataLoader(dataset(), batch_size=4, sampler=sampler))


def test_custom_batch_sampler_warns():
    text = messages(DataLoader(dataset(), batch_sampler=[[0, 1], [2, 3]]))
    assert "custom batch sampler" in text and "not Poisson samples" in text


def test_unbatched_loader_and_non_loader():
    assert "batch_size=None" in messages(DataLoader(dataset(), batch_size=None))
    with pytest.raises(TypeError, match="data_loader"):
        check_sampling([1, 2])


def _make_private_without_poisson(sampler):
    from opacus_dp import PrivacyEngine
    data = TensorDataset(torch.randn(20, 2), torch.randint(0, 2, (20,)))
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=5, sampler=sampler), noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)


@pytest.mark.parametrize("replacement, num_samples, words", [
    (True, 20, "replacement=True, num_samples=20"),   # an example can fill two rows of one batch
    (False, 200, "about 10 batches per pass"),         # 10 draws of each example per pass at q = 1/40
    (True, 200, "replacement=True, num_samples=200"),
])
def test_a_random_sampler_drawing_examples_more_than_once_per_pass_is_refused(replacement, num_samples, words):
    data = TensorDataset(torch.randn(20, 2))
    sampler = torch.utils.data.RandomSampler(data, replacement=replacement, num_samples=num_samples)
    with pytest.raises(ValueError, match="poisson_sampling=True") as refused:
        _make_private_without_poisson(sampler)
    assert words in str(refused.value)


def test_a_weighted_sampler_drawing_with_replacement_is_refused():
    """Its default draws with replacement: an example can fill two rows of one batch (2C)."""
    weights = torch.ones(20)
    assert len(set(WeightedRandomSampler(weights, 20, generator=torch.Generator().manual_seed(0)))) < 20
    with pytest.raises(ValueError, match=r"WeightedRandomSampler\(replacement=True\).*poisson_sampling=True"):
        _make_private_without_poisson(WeightedRandomSampler(weights, num_samples=20))
    _, _, loader = _make_private_without_poisson(WeightedRandomSampler(weights, 20, replacement=False))
    assert loader.batch_sampler.sampler.replacement is False


def test_a_shuffling_or_subsampling_random_sampler_is_accepted():
    data = TensorDataset(torch.randn(20, 2))
    for sampler in (torch.utils.data.RandomSampler(data), torch.utils.data.RandomSampler(data, num_samples=10)):
        _, optimizer, loader = _make_private_without_poisson(sampler)
        assert loader.sampler is sampler or loader.batch_sampler.sampler is sampler
