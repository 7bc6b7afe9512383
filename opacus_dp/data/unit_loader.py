"""``UnitDataLoader``: Poisson batches of privacy units (users, augmented examples), each batch's
grouping of rows into units delivered to a :class:`~opacus_dp.maths.unit_groups.UnitChannel`
when the batch reaches the training loop (:mod:`opacus_dp.data.unit_sampling`)."""

from typing import Callable, Optional

from torch.utils.data import DataLoader

from opacus_dp.data.collate import EmptyBatchCollate, unwrap_collate
from opacus_dp.data.collate_rows import check_keeps_order
from opacus_dp.data.data_loader import SamplingGeneratorKept, worker_seed_generator, worker_settings
from opacus_dp.data.hand_out_state import HandOutState
from opacus_dp.data.samplers import generator_from_global_rng
from opacus_dp.data.step_per_batch import StepPerBatch
from opacus_dp.data.unit_sampling import UnitPoissonSampler, units_of
from opacus_dp.maths.unit_groups import UnitChannel


ORDER_PROBES = 8  # pairs of examples a collate is shown in both orders (a stable sort keeps equal keys')


class UnitDataLoader(HandOutState, SamplingGeneratorKept, DataLoader):
    """DataLoader over a :class:`~opacus_dp.data.unit_sampling.UnitPoissonSampler`.

    ``sample_rate`` is the units' rate ``q`` (what the accountant records), ``len(loader)`` the
    steps per pass, ``unit_channel`` the channel each delivered batch's grouping goes to (the
    per-sample gradient source reads it), ``privacy_unit`` ``"user"`` or ``"example"``.
    Batches are delivered in the sampler's order (``in_order``), so the groupings stay aligned
    with worker prefetching.
    """

    def __init__(self, dataset, sampler: UnitPoissonSampler, *, privacy_unit: str, collate_fn: Optional[Callable] = None,
                 batch_first: bool = True, channel: Optional[UnitChannel] = None, **workers):
        collate = EmptyBatchCollate.from_dataset(dataset, unwrap_collate(collate_fn), batch_first=batch_first)
        for other in range(1, min(len(dataset), ORDER_PROBES + 1)):  # units group rows by position
            check_keeps_order(collate.collate_fn, dataset[0], dataset[other])  # (collate_rows.py)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate, generator=sampler.generator,
                         in_order=True, **workers)
        self.sample_rate = sampler.sample_rate
        self.distributed = sampler.distributed
        self.batch_first = batch_first
        self.privacy_unit = privacy_unit
        self.unit_channel = channel if channel is not None else UnitChannel()
        self._seed_generator = worker_seed_generator(sampler.generator)
        self._iterators = 0
        self.step_per_batch = StepPerBatch()  # connected by make_private (data/step_per_batch.py)

    def __iter__(self):
        """Batches in the sampler's order, each batch's grouping delivered with it, each refused
        while its predecessor got no step once ``step_per_batch`` follows an optimizer. Only the
        newest iterator may be used: the groupings of an older one were dropped when it started."""
        return self.step_per_batch.checked(self._delivered())

    def _delivered(self):
        self._iterators += 1
        mine = self._iterators
        layouts = self.batch_sampler.layouts
        log = self._start_pass()  # (workers draw ahead: hand_out_state.py)
        batches = super().__iter__()
        for batch in batches if log is None else self._noting_states(batches, log):
            if mine != self._iterators:
                raise RuntimeError(
                    "a batch of an older iterator of the privacy-unit loader was requested after a newer "
                    "iterator was created: iterate one pass at a time (the rows' grouping into units "
                    "follows the newest pass)")
            self.unit_channel.deliver(layouts.popleft())
            yield batch


def unit_loader(data_loader: DataLoader, *, user_ids=None, max_examples_per_user: Optional[int] = None,
                augmentation_multiplicity: int = 1, unit_gradient: str = "mean", generator=None,
                distributed: bool = False, batch_first: bool = True) -> UnitDataLoader:
    """The unit loader replacing ``data_loader``: units are users (``user_ids`` given) or examples,
    ``q = 1/len(data_loader)`` (each unit once per pass in expectation, ``len(data_loader)`` steps)
    unless ``data_loader`` has its own ``sample_rate``."""
    dataset = data_loader.dataset
    if user_ids is not None:
        units, unit = units_of(user_ids, len(dataset)), "user"
    else:
        units, unit = [[i] for i in range(len(dataset))], "example"
    rate = getattr(data_loader, "sample_rate", None)
    sampler = UnitPoissonSampler(
        units, sample_rate=float(rate) if rate is not None else 1.0 / len(data_loader),
        max_rows_per_unit=max_examples_per_user, multiplicity=augmentation_multiplicity,
        unit_gradient=unit_gradient, generator=generator if generator is not None else
        (data_loader.generator or generator_from_global_rng()),
        steps=len(data_loader), distributed=distributed)
    return UnitDataLoader(dataset, sampler, privacy_unit=unit, collate_fn=data_loader.collate_fn,
                          batch_first=batch_first, **worker_settings(data_loader))
