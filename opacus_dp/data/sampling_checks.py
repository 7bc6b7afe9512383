"""Warnings when a data loader does not sample the way the privacy accountant assumes.

The accountants analyse the subsampled Gaussian mechanism with *Poisson* sampling at rate q:
every example enters every batch independently with probability q. Fixed-size shuffled
batches are a different mechanism whose privacy can be markedly worse than the Poisson
numbers suggest (Chua et al. 2024, "How Private are DP-SGD Implementations?"); non-uniform
samplers give some examples a rate above q; ``drop_last`` silently changes the batch set.
"""

import warnings
from typing import List

from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from opacus_dp.data.samplers import DistributedPoissonBatchSampler, UniformWithReplacementSampler


class SamplingWarning(UserWarning):
    """The loader's sampling differs from the Poisson sampling the accountant assumes."""


POISSON_SAMPLERS = (UniformWithReplacementSampler, DistributedPoissonBatchSampler)


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
    elif not isinstance(batch_sampler.sampler, (RandomSampler, SequentialSampler)):
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

