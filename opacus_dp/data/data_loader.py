"""``DPDataLoader``: a torch DataLoader that draws Poisson batches and survives empty ones."""

import copy
import warnings
from typing import Callable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from opacus_dp.data.collate import EmptyBatchCollate, unwrap_collate
from opacus_dp.data.hand_out_state import HandOutState
from opacus_dp.data.sampling_checks import check_batching, check_replaceable_sampler
from opacus_dp.data.samplers import (
    DistributedPoissonBatchSampler,
    UniformWithReplacementSampler,
    check_sample_rate,
    generator_from_global_rng,
)
from opacus_dp.data.step_per_batch import StepPerBatch, register_loader


def worker_settings(data_loader: DataLoader) -> dict:
    """The worker / memory settings of ``data_loader`` (everything but sampling and collation)."""
    return dict(
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        prefetch_factor=data_loader.prefetch_factor,
        persistent_workers=data_loader.persistent_workers,
        pin_memory_device=getattr(data_loader, "pin_memory_device", ""),
    )


def _check_map_style(dataset, where: str) -> None:
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"{where}: Poisson sampling needs random access, but the dataset is an IterableDataset; "
            "use a map-style Dataset (with __len__ and __getitem__)"
        )


def worker_seed_generator(generator) -> torch.Generator:
    """A generator for the iterators' base seeds (worker seeds), derived from ``generator``'s
    initial seed without drawing from it (a fresh one from torch's global RNG if it has none)."""
    initial = getattr(generator, "initial_seed", None)
    if not callable(initial):
        return generator_from_global_rng()
    return torch.Generator().manual_seed((initial() * 0x9E3779B97F4A7C15 + 1) % 2**63)


class SamplingGeneratorKept:
    """Mixin of the DP loaders: a new iterator draws its base seed (for the worker seeds) from
    ``self._seed_generator``, not from ``loader.generator``, which only the batch sampler draws
    from. So iterating does not advance the sampling generator: a run resumed mid-epoch from a
    saved ``loader.generator`` state draws the batches the uninterrupted run would have drawn
    (``DataLoader`` itself takes the base seed from ``loader.generator``)."""

    _seed_generator: Optional[torch.Generator] = None

    def __iter__(self):
        sampling, self.generator = self.generator, self._seed_generator
        try:
            return super().__iter__()
        finally:
            self.generator = sampling


class DPDataLoader(HandOutState, SamplingGeneratorKept, DataLoader):
    """DataLoader whose batches are Poisson samples: each example is in each batch w.p. ``sample_rate``.

    ``len(loader)`` is the number of steps per pass (default ``round(1/q)``), the expected batch
    size is ``q·N`` (``q·N/R`` per rank when ``distributed``), and an empty batch is delivered as a
    batch of the usual structure with zero rows (see ``opacus_dp.data.collate``). The sampling
    randomness comes from ``generator`` (a fresh one seeded from torch's global RNG by default),
    exposed as ``loader.generator`` so that ``loader.generator.get_state()`` can be checkpointed.
    ``drop_last`` has no meaning for Poisson batches and is ignored with a warning, as is Opacus
    1.x's ``rand_on_empty`` (empty batches already have the right structure).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        collate_fn: Optional[Callable] = None,
        drop_last: bool = False,
        generator=None,
        distributed: bool = False,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        steps: Optional[int] = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable] = None,
        multiprocessing_context=None,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ):
        _check_map_style(dataset, "DPDataLoader")
        if len(dataset) == 0:
            raise ValueError("DPDataLoader: the dataset is empty, there is nothing to sample from")
        self.sample_rate = check_sample_rate(sample_rate)
        self.distributed = bool(distributed)
        self.batch_first = bool(batch_first)
        generator = generator_from_global_rng() if generator is None else generator
        if drop_last:
            warnings.warn("DPDataLoader ignores drop_last=True: Poisson batches have no fixed size", UserWarning)
        if rand_on_empty:
            warnings.warn("DPDataLoader ignores rand_on_empty=True (Opacus 1.x: one random example instead of "
                          "an empty batch): an empty batch is delivered with the usual structure and zero rows",
                          UserWarning)
        batch_sampler = self._make_batch_sampler(len(dataset), generator, steps)
        collate = EmptyBatchCollate.from_dataset(dataset, unwrap_collate(collate_fn), batch_first=batch_first)
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate,
            generator=generator,
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        self._seed_generator = worker_seed_generator(generator)
        self.step_per_batch = StepPerBatch()  # connected by make_private to the optimizer's steps
        if type(self) is DPDataLoader and not self.distributed:  # or by a classic engine (poisson=True)
            register_loader(self)

    def __iter__(self):
        """The batches of one pass; refuses a batch whose predecessor got no step, once
        ``step_per_batch`` follows an optimizer (:mod:`~opacus_dp.data.step_per_batch`)."""
        return self.iter_after(0)

    def iter_after(self, dropped: int):
        """An iterator of one pass whose first ``dropped`` batches are drawn and dropped (a pass
        resumed inside, so that the sampling continues exactly), checked as :meth:`__iter__`."""
        log = self._start_pass()
        batches = super().__iter__()
        if log is not None:
            batches = self._noting_states(batches, log)
        if dropped or self.step_per_batch.connected:
            batches = self.step_per_batch.checked(batches, dropped)
        return batches

    def _make_batch_sampler(self, num_samples: int, generator, steps):
        if self.distributed:
            return DistributedPoissonBatchSampler(
                total_size=num_samples, sample_rate=self.sample_rate, generator=generator, steps=steps
            )
        return UniformWithReplacementSampler(
            num_samples=num_samples, sample_rate=self.sample_rate, generator=generator, steps=steps,
            skip_empty=False,  # delivered as empty batches (EmptyBatchCollate)
        )

    @classmethod
    def from_data_loader(
        cls, data_loader: DataLoader, *, generator=None, distributed: bool = False, batch_first: bool = True
    ) -> "DPDataLoader":
        """A Poisson loader over ``data_loader.dataset`` with ``q = 1/len(data_loader)``.

        So the expected batch size is ``N/len(data_loader)`` (≈ the original batch size) and one
        pass has ``len(data_loader)`` steps. A ``DPDataLoader`` keeps its own sample rate and number
        of steps per pass. Dataset, collate function, worker settings and (unless ``generator`` is
        given) the generator are taken from ``data_loader``.
        """
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        _check_map_style(data_loader.dataset, "DPDataLoader.from_data_loader")
        check_batching(data_loader, "DPDataLoader.from_data_loader")
        check_replaceable_sampler(data_loader, "DPDataLoader.from_data_loader")
        is_dp = isinstance(data_loader, DPDataLoader)
        return cls(
            data_loader.dataset,
            sample_rate=data_loader.sample_rate if is_dp else 1.0 / len(data_loader),
            collate_fn=data_loader.collate_fn,
            generator=generator if generator is not None else data_loader.generator,
            distributed=distributed,
            batch_first=batch_first,
            steps=len(data_loader) if is_dp else None,
            **worker_settings(data_loader),
        )


def switch_generator(*, data_loader: DataLoader, generator) -> DataLoader:
    """A loader behaving like ``data_loader`` but drawing its randomness from ``generator``.

    Used e.g. to put a cryptographically secure generator behind a user's loader. The samplers of
    ``data_loader`` are copied, not modified.
    """
    if isinstance(data_loader, DPDataLoader):
        return DPDataLoader(
            data_loader.dataset,
            sample_rate=data_loader.sample_rate,
            collate_fn=data_loader.collate_fn,
            generator=generator,
            distributed=data_loader.distributed,
            batch_first=data_loader.batch_first,
            steps=len(data_loader),
            **worker_settings(data_loader),
        )
    batch_sampler = data_loader.batch_sampler
    if batch_sampler is None:
        raise ValueError("switch_generator: data_loader has automatic batching disabled (batch_size=None)")
    batch_sampler = copy.copy(batch_sampler)
    if isinstance(batch_sampler, BatchSampler):
        if not hasattr(batch_sampler.sampler, "generator"):
            raise ValueError(
                f"switch_generator: the sampler {type(batch_sampler.sampler).__name__} has no generator to replace"
            )
        batch_sampler.sampler = copy.copy(batch_sampler.sampler)
        batch_sampler.sampler.generator = generator
    elif hasattr(batch_sampler, "generator"):
        batch_sampler.generator = generator
    else:
        raise ValueError(f"switch_generator: the batch sampler {type(batch_sampler).__name__} has no generator")
    return DataLoader(
        data_loader.dataset,
        batch_sampler=batch_sampler,
        collate_fn=data_loader.collate_fn,
        generator=generator,
        **worker_settings(data_loader),
    )
