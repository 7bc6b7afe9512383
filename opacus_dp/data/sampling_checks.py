"""Warnings when a data loader does not sample the way the privacy accountant assumes.

The accountants analyse the subsampled Gaussian mechanism with *Poisson* sampling at rate q:
every example enters every batch independently with probability q. Fixed-size shuffled
batches are a different mechanism whose privacy can be markedly worse than the Poisson
numbers suggest (Chua et al. 2024, "How Private are DP-SGD Implementations?"); non-uniform
samplers give some examples a rate above q; ``drop_last`` silently changes the batch set.
"""

import warnings
from typing import List, Optional

from torch.utils.data import (BatchSampler, DataLoader, RandomSampler, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler)
from torch.utils.data.distributed import DistributedSampler

from opacus_dp.data.samplers import DistributedPoissonBatchSampler, UniformWithReplacementSampler
from opacus_dp.data.sampling_warning import SamplingWarning


POISSON_SAMPLERS = (UniformWithReplacementSampler, DistributedPoissonBatchSampler)
UNIFORM_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)  # every example alike


def _logical_batch_sampler(data_loader: DataLoader):
    """The batch sampler drawing logical batches (looks through BatchMemoryManager's splitter)."""
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    return getattr(batch_sampler, "batch_sampler", batch_sampler)


def is_poisson_loader(data_loader: DataLoader) -> bool:
    """True when ``data_loader`` draws its (logical) batches with one of the Poisson batch samplers."""
    return isinstance(_logical_batch_sampler(data_loader), POISSON_SAMPLERS)


def _sampler_problems(data_loader: DataLoader, poisson_expected: bool) -> List[str]:
    batch_sampler = _logical_batch_sampler(data_loader)
    if isinstance(batch_sampler, POISSON_SAMPLERS):
        return []
    problems = []
    if batch_sampler is None:
        return ["the loader does not batch (batch_size=None); DP-SGD needs batches of examples"]
    if not isinstance(batch_sampler, BatchSampler):
        problems.append(
            f"custom batch sampler {type(batch_sampler).__name__}: its inclusion probabilities are unknown, "
            "so the accountant's sample rate may under-state the privacy loss"
        )
    elif not isinstance(batch_sampler.sampler, UNIFORM_SAMPLERS):
        problems.append(
            f"sampler {type(batch_sampler.sampler).__name__} is not uniform (e.g. weighted): examples drawn "
            "more often than the sample rate q lose more privacy than the accountant reports"
        )
    if getattr(batch_sampler, "drop_last", False) or data_loader.drop_last:
        problems.append("drop_last=True: the examples of the last partial batch are never seen in that pass")
    kind = "Poisson sampling was requested" if poisson_expected else "the accountant assumes Poisson sampling"
    batches = "fixed-size batches" if isinstance(batch_sampler, BatchSampler) else "batches that are not Poisson samples"
    problems.append(
        f"{kind} but the loader draws {batches}, whose privacy is not covered by the Poisson analysis. "
        "Use DPDataLoader (poisson_sampling=True)"
    )
    return problems


def check_draws_each_example_once(data_loader: DataLoader, where: str) -> None:
    """Refuse a ``RandomSampler`` that draws with replacement or more examples per pass than the
    dataset has, for a loader kept as it is (``q = 1/len(loader)``): with replacement an example
    can fill two rows of one batch (clipped twice: 2C, noised for C), and ``k·N`` draws per pass
    put each example in about ``k`` batches per pass, ``k`` times the rate ``1/len(loader)`` the
    accountant would record. A ``WeightedRandomSampler`` drawing with replacement (its default) is
    refused for the first reason."""
    sampler = getattr(_logical_batch_sampler(data_loader), "sampler", None)
    if isinstance(sampler, WeightedRandomSampler) and sampler.replacement:
        raise ValueError(
            f"{where}: WeightedRandomSampler(replacement=True) draws with replacement, so an example can "
            "fill two rows of one batch (clipped twice, a sensitivity of 2C, while the noise covers C). "
            "Use poisson_sampling=True (every example at the same rate q; to rebalance classes, weight "
            "the loss per example instead), or WeightedRandomSampler(..., replacement=False)")
    if not isinstance(sampler, RandomSampler):
        return
    n, draws = len(sampler.data_source), sampler.num_samples
    if sampler.replacement or draws > n:
        raise ValueError(
            f"{where}: RandomSampler(replacement={sampler.replacement}, num_samples={draws}) over {n} examples "
            "draws an example more than once per pass: with replacement it can fill two rows of one batch "
            "(clipped twice, a sensitivity of 2C), and with more draws than examples each example is in "
            f"about {draws / n:.3g} batches per pass while the accountant records q = 1/len(data_loader). "
            "Use poisson_sampling=True (its rate q = 1/len(data_loader) is the rate it draws), or a "
            "sampler that draws each example once per pass (shuffle=True)")


def check_batching(data_loader: DataLoader, where: str) -> None:
    """Refuse a loader without batches (``batch_size=None``: each example would arrive without
    a batch dimension and its rows be clipped as separate examples), without a length (the
    sample rate ``q = 1/len(loader)`` needs the number of batches per pass) or of length 0."""
    batch_sampler = data_loader.batch_sampler
    if batch_sampler is None:
        raise ValueError(
            f"{where}: data_loader has automatic batching disabled (batch_size=None), so each "
            "example would arrive without a batch dimension and its rows be clipped as separate "
            "examples; give the DataLoader a batch_size (if each item of the dataset is already "
            "a batch: DataLoader(dataset, batch_size=1, collate_fn=lambda items: items[0]))"
        )
    try:
        batches = len(data_loader)
    except TypeError:
        raise ValueError(
            f"{where}: the batch sampler {type(batch_sampler).__name__} has no len(); the sample "
            "rate q = 1/len(data_loader) needs the number of batches per pass: define __len__"
        ) from None
    if batches == 0:
        raise ValueError(f"{where}: data_loader yields no batches (an empty dataset, or "
                         "drop_last=True with batch_size above the dataset size?)")


def check_replaceable_sampler(data_loader: DataLoader, where: str) -> None:
    """Poisson sampling draws from the whole dataset, each example at the same rate: refuse a
    loader whose sampler chose a subset or weights (it would be dropped silently, e.g. training
    on held-out examples), warn about any other custom sampler being replaced."""
    batch_sampler = _logical_batch_sampler(data_loader)
    if isinstance(batch_sampler, POISSON_SAMPLERS):
        return
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else batch_sampler
    name = type(sampler).__name__
    if isinstance(sampler, SubsetRandomSampler):
        raise ValueError(
            f"{where}: the loader's {name} draws from a subset of the dataset, but Poisson sampling "
            "draws from the whole dataset: pass the subset as the dataset "
            "(torch.utils.data.Subset(dataset, indices)) with a plain batch_size"
        )
    if isinstance(sampler, WeightedRandomSampler):
        raise ValueError(
            f"{where}: the loader's {name} weights the examples, but Poisson sampling gives every "
            "example the same rate q (what the accountant analyses): remove the sampler (to "
            "rebalance, weight the loss per example instead)"
        )
    if not isinstance(sampler, UNIFORM_SAMPLERS):
        warnings.warn(
            f"{where}: the loader's {name} is replaced by Poisson sampling over the whole "
            f"dataset ({len(data_loader.dataset)} examples, each at rate q)", SamplingWarning, stacklevel=3)


def _distributed_sampler(data_loader: DataLoader) -> Optional[DistributedSampler]:
    """The loader's ``DistributedSampler`` (looking through BatchMemoryManager's splitter), if any."""
    batch_sampler = _logical_batch_sampler(data_loader)
    for sampler in (getattr(batch_sampler, "sampler", None), batch_sampler, getattr(data_loader, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def check_no_padding_across_ranks(data_loader: DataLoader, where: str) -> None:
    """Refuse a ``DistributedSampler`` that pads the shards by repeating examples (``drop_last=False``
    and N not divisible by ``num_replicas``): a repeated example can be in two ranks' batches of one
    step, clipped on each, so it adds 2C to the all-reduced sum while the noise covers C."""
    sampler = _distributed_sampler(data_loader)
    if sampler is None or sampler.drop_last:
        return
    n, replicas = len(sampler.dataset), sampler.num_replicas
    padding = -n % replicas
    if padding:
        raise ValueError(
            f"{where}: {type(sampler).__name__}(drop_last=False) pads the {n} examples to a multiple of "
            f"num_replicas={replicas} by repeating {padding} of them, so one example can be in two ranks' "
            "batches of the same step: clipped on each rank, it adds 2C to the all-reduced sum while the "
            "noise covers C (sensitivity 2C). Build the sampler with DistributedSampler(dataset, "
            f"drop_last=True) (each pass then leaves out {n % replicas} of the {n}), or use "
            "poisson_sampling=True (disjoint Poisson batches drawn from the whole dataset)"
        )


def check_sampling(data_loader: DataLoader, poisson_expected: bool = True) -> List[str]:
    """Warn (``SamplingWarning``) about every way ``data_loader`` departs from Poisson sampling.

    ``poisson_expected=True``: the loader is supposed to be Poisson already (e.g. a DPDataLoader).
    ``poisson_expected=False``: a user loader is kept and accounted as if it were Poisson with
    ``q = 1/len(loader)``. Either way the problems are warned about, never silently assumed away.
    Returns the list of messages (empty when the loader is a Poisson loader).
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    problems = _sampler_problems(data_loader, poisson_expected)
    for message in problems:
        warnings.warn(message, SamplingWarning, stacklevel=2)
    return problems

