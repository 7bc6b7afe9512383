"""``BatchMemoryManager``: bound the physical batch size without changing the logical (private) one.

A logical batch (one Poisson sample, one privacy step) is cut into physical batches of at most
``max_physical_batch_size`` examples. Right before each physical batch reaches the training loop
the optimizer is told whether the step after it must be skipped (``do_skip=True``: more chunks of
the same logical batch follow, keep accumulating clipped gradients) or taken (``do_skip=False``:
the last chunk). An empty logical batch still yields one empty physical batch with
``do_skip=False``, so its step (noise only) is taken and accounted.

A signal belongs to its chunk. When the next chunk is handed out and a previous chunk's signal
was not consumed by ``step()``, the loop skipped that step: a skipped mid-batch step is
harmless (its signal is dropped), but a logical batch whose last chunk got no ``step()`` would
merge into the next one, or (an empty batch skipped with ``continue``) leave a Poisson step
unaccounted, so it is refused. A loop that ends in the middle of a logical batch (``break``, an
exception) drops that batch's clipped gradients (never released: no noise, no record) instead
of leaving them to join the next step.

With the Poisson batches of ``make_private`` this is the only way to take several backward
passes per step: the optimizer refuses ``virtual_step()`` and ``signal_skip_step(True)`` from
the loop itself, which cannot show that the pieces come from one sampled batch.
"""

import math
import warnings
from collections import deque
from typing import Iterator, List, Optional

from torch.utils.data import BatchSampler, DataLoader, Sampler

from opacus_dp.data.data_loader import SamplingGeneratorKept, worker_seed_generator, worker_settings
from opacus_dp.data.samplers import DistributedPoissonBatchSampler, check_positive_int, count_logical_batch
from opacus_dp.maths.unit_groups import UnitGroups
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind


def split_indices(indices: List[int], max_size: int, chunks: Optional[int] = None) -> List[List[int]]:
    """Cut ``indices`` into ``k = max(1, ceil(n/max_size))`` (or ``chunks``) consecutive chunks whose
    sizes differ by ≤ 1 (some empty if ``chunks > n``).

    The first ``n mod k`` chunks hold one extra index (the layout of ``numpy.array_split``).
    """
    n = len(indices)
    k = max(1, math.ceil(n / max_size)) if chunks is None else chunks
    bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
    return [list(indices[bounds[i] : bounds[i + 1]]) for i in range(k)]


def unit_pieces(sizes: List[int], max_size: int) -> List[List[int]]:
    """The unit sizes of each chunk when consecutive units are packed into chunks of at most
    ``max_size`` rows (at least one chunk); a unit larger than ``max_size`` is refused."""
    pieces: List[List[int]] = [[]]
    for size in sizes:
        if size > max_size:
            raise ValueError(
                f"BatchMemoryManager: a privacy unit (a user's examples, or an example's augmentations) has "
                f"{size} rows, more than max_physical_batch_size={max_size}; its rows must go through one "
                "physical batch (they are clipped together): raise max_physical_batch_size or lower "
                "max_examples_per_user")
        if pieces[-1] and sum(pieces[-1]) + size > max_size:
            pieces.append([])
        pieces[-1].append(size)
    return pieces


def counts_logical_batches(batch_sampler) -> bool:
    """Whether ``batch_sampler`` is a distributed one whose logical batches the splitter counts."""
    return isinstance(batch_sampler, DistributedPoissonBatchSampler) or \
        bool(getattr(batch_sampler, "distributed", False) and hasattr(batch_sampler, "draw"))


class BatchSplittingSampler(Sampler[List[int]]):
    """Batch sampler yielding the physical chunks of each logical batch of ``batch_sampler``.

    For every chunk it appends the matching ``do_skip`` flag to ``self.skip_flags``; the loader
    pops them in the same order when it hands the collated chunks out.
    """

    def __init__(self, *, batch_sampler, max_batch_size: int, equal_passes: bool = False):
        self.batch_sampler = batch_sampler
        self.max_batch_size = check_positive_int(max_batch_size, "max_physical_batch_size")
        self.equal_passes = equal_passes
        self.skip_flags: deque = deque()
        self.layouts: deque = deque()  # UnitGroups of each chunk, for a unit sampler's batches

    def _split_between_units(self, indices: List[int], groups) -> List[List[int]]:
        """Chunks of whole units (a unit's rows are never split: its gradient is clipped as one),
        each of at most ``max_size`` rows; the chunks' groupings are queued in ``self.layouts``.
        With ``equal_passes``, as many chunks as the rank that needs the most (some empty)."""
        sizes = groups.sizes()
        pieces = unit_pieces(sizes, self.max_batch_size)
        if self.equal_passes:
            most = max(len(unit_pieces(s, self.max_batch_size)) for s in self.batch_sampler.unit_sizes_of_ranks())
            pieces += [[] for _ in range(most - len(pieces))]
        chunks, start = [], 0
        for piece in pieces:
            chunks.append(indices[start:start + sum(piece)])
            start += sum(piece)
            self.layouts.append(UnitGroups.from_sizes(piece, groups.unit_gradient))
        return chunks

    def _num_chunks(self, size: int) -> int:
        """``max(1, ceil(size / max))``; with ``equal_passes`` the largest such count over the ranks
        (every rank then runs the same number of forward/backward passes, as FSDP2 needs)."""
        sizes = self.batch_sampler.batch_sizes_of_ranks() if self.equal_passes else [size]
        return max(1, *(math.ceil(s / self.max_batch_size) for s in sizes))

    def __iter__(self) -> Iterator[List[int]]:
        counted_here = counts_logical_batches(self.batch_sampler)
        logicals = self.batch_sampler.draw(count_batches=False) if counted_here else self.batch_sampler
        units = getattr(self.batch_sampler, "layouts", None)  # a unit sampler: cut between units
        self.layouts.clear()
        for logical in logicals:
            if units is None:
                chunks = split_indices(list(logical), self.max_batch_size, self._num_chunks(len(logical)))
            else:
                chunks = self._split_between_units(list(logical), units.popleft())
            for position, chunk in enumerate(chunks):
                self.skip_flags.append(position < len(chunks) - 1)
                yield chunk

    def __len__(self) -> int:
        """Estimated number of physical batches: ``ceil(steps · max(1, E|B| / max_size))``."""
        steps = len(self.batch_sampler)
        if hasattr(self.batch_sampler, "expected_batch_size"):
            expected = self.batch_sampler.expected_batch_size()
        elif isinstance(self.batch_sampler, BatchSampler):
            expected = self.batch_sampler.batch_size
        else:
            return steps
        return math.ceil(steps * max(1.0, expected / self.max_batch_size))


class PhysicalBatchLoader(SamplingGeneratorKept, DataLoader):
    """DataLoader over the physical chunks; signals ``optimizer.signal_skip_step`` per chunk.

    The signal is sent when a chunk is handed to the caller (not when its indices are drawn),
    so worker prefetching cannot put the signals out of order.
    """

    def __init__(self, data_loader: DataLoader, *, max_physical_batch_size: int, optimizer):
        self.optimizer = optimizer
        super().__init__(
            data_loader.dataset,
            batch_sampler=BatchSplittingSampler(
                batch_sampler=data_loader.batch_sampler, max_batch_size=max_physical_batch_size,
                equal_passes=_needs_equal_passes(data_loader, optimizer)),
            collate_fn=data_loader.collate_fn,
            generator=data_loader.generator,
            in_order=True,
            **worker_settings(data_loader),
        )
        self._seed_generator = getattr(data_loader, "_seed_generator", None) \
            or worker_seed_generator(data_loader.generator)
        self.unit_channel = getattr(data_loader, "unit_channel", None)  # units: groupings delivered per chunk

    def __iter__(self):
        splitter = self.batch_sampler
        splitter.skip_flags.clear()
        dp_optimizer = dp_optimizer_behind(self.optimizer)
        _discard_unfinished(dp_optimizer)  # left by an earlier loop that did not finish
        finished = False
        counts = counts_logical_batches(splitter.batch_sampler)
        channel = self.unit_channel
        first_piece = True
        try:
            for batch in super().__iter__():
                _check_previous_steps(dp_optimizer)
                do_skip = splitter.skip_flags.popleft()
                if channel is not None:
                    channel.deliver(splitter.layouts.popleft())
                _signal_chunk(self.optimizer, dp_optimizer, do_skip)
                if counts and first_piece:  # the logical batch reaches the loop (step_clock.py)
                    count_logical_batch()
                first_piece = not do_skip
                yield batch
            _check_previous_steps(dp_optimizer)
            finished = True
        finally:
            if not finished:
                _discard_unfinished(dp_optimizer)


def _needs_equal_passes(data_loader: DataLoader, optimizer) -> bool:
    """Whether every rank must run as many passes as the others (FSDP2: each forward and backward
    pass is a collective), which needs a batch sampler that knows every rank's batch size."""
    dp_optimizer = dp_optimizer_behind(optimizer)
    reducer = None if dp_optimizer is None else dp_optimizer.reducer
    if reducer is None or not reducer.needs_equal_passes or reducer.world_size == 1:
        return False
    if not counts_logical_batches(data_loader.batch_sampler):
        raise ValueError(
            "BatchMemoryManager under FSDP2 needs the distributed Poisson loader make_private returns "
            "(poisson_sampling=True): every rank must cut its batch into the same number of pieces, "
            "since each forward and backward pass is a collective, and only that loader tells every "
            "rank the others' batch sizes")
    return True


def _signal_chunk(optimizer, dp_optimizer, do_skip: bool) -> None:
    """Tell the optimizer whether the coming ``step()`` ends the logical batch; a DPOptimizer
    learns that the pieces come from one sampled batch (allowed with Poisson batches)."""
    if dp_optimizer is not None and callable(getattr(dp_optimizer, "signal_chunk_step", None)):
        dp_optimizer.signal_chunk_step(do_skip)
    else:
        optimizer.signal_skip_step(do_skip=do_skip)


def _check_previous_steps(dp_optimizer) -> None:
    """Refuse a logical batch whose last chunk got no ``step()`` (module doc)."""
    if dp_optimizer is None:
        return
    if not all(dp_optimizer.take_unconsumed_skip_signals()):
        dropped = dp_optimizer.discard_unfinished_batch()
        raise RuntimeError(
            "BatchMemoryManager: the last physical batch of a logical batch got no "
            "optimizer.step() (was an empty batch skipped with `continue`?). Every logical batch, "
            "also an empty one, must end in optimizer.step(): it adds the noise and the "
            "accountant records it (an empty batch goes through the model and the loss like any "
            f"other). The clipped gradients of that batch's {dropped} samples were dropped; "
            "nothing was updated"
        )


def _discard_unfinished(dp_optimizer) -> None:
    if dp_optimizer is None:
        return
    dropped = dp_optimizer.discard_unfinished_batch()
    if dropped:
        warnings.warn(
            f"BatchMemoryManager: a loop ended inside a logical batch; the clipped gradients of "
            f"its {dropped} samples were dropped (no step was taken for them, so they cost no "
            "privacy and cannot join the next step)",
            RuntimeWarning, stacklevel=3,
        )


def _check_arguments(data_loader, max_physical_batch_size, optimizer) -> None:
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    if data_loader.batch_sampler is None:
        raise ValueError("data_loader has automatic batching disabled (batch_size=None); nothing to split")
    check_positive_int(max_physical_batch_size, "max_physical_batch_size")
    if not callable(getattr(optimizer, "signal_skip_step", None)):
        raise TypeError(
            f"optimizer must provide signal_skip_step(do_skip=...) (a DPOptimizer), got {type(optimizer).__name__}"
        )


class BatchMemoryManager:
    """Context manager returning a loader of physical batches of at most ``max_physical_batch_size``.

    >>> with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32, optimizer=opt) as physical:
    ...     for x, y in physical:
    ...         loss_fn(model(x), y).backward()
    ...         opt.step()        # a real step only after the last chunk of a logical batch
    ...         opt.zero_grad()

    The given loader is not modified; iterate the returned one.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer):
        _check_arguments(data_loader, max_physical_batch_size, optimizer)
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer

    def __enter__(self) -> PhysicalBatchLoader:
        return PhysicalBatchLoader(
            self.data_loader, max_physical_batch_size=self.max_physical_batch_size, optimizer=self.optimizer
        )

    def __exit__(self, exc_type, exc_value, traceback) -> bool:
        _discard_unfinished(dp_optimizer_behind(self.optimizer))  # also if the loop was left early
        return False


def wrap_data_loader(*, data_loader: DataLoader, max_batch_size: int, optimizer) -> PhysicalBatchLoader:
    """Functional form of ``BatchMemoryManager`` (Opacus 1.x name)."""
    _check_arguments(data_loader, max_batch_size, optimizer)
    return PhysicalBatchLoader(data_loader, max_physical_batch_size=max_batch_size, optimizer=optimizer)
