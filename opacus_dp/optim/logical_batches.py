"""How the pieces of a logical batch reach one private step (the ``DPOptimizer`` side).

Everything accumulated until ``step()`` is ONE logical batch for the accountant (one record):
pieces cut by ``virtual_step()`` / ``signal_skip_step()`` / ``BatchMemoryManager``, or ``k``
backward passes merged without them (counted: the accountant records ``k·q``). With the Poisson
batches of ``make_private`` only ``BatchMemoryManager`` may cut a batch (``signal_chunk_step``),
and a step over more samples than ``max_batch_size`` per merged batch is refused.
"""

from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class BatchingPolicy:
    """How the pieces and backward passes before one step form its logical batch (chosen by the
    privacy engine, fixed for the optimizer's life).

    Args:
        count_iterations: ``k`` backward passes merged without ``virtual_step`` count as ``k``
            sampled batches: the mean divides by ``k · E|B|`` and the accountant records
            ``min(1, k·q)`` (Opacus 1.x). False: everything between two steps is one logical
            batch (Opacus 0.x).
        max_batch_size: fixed-size batches: the most samples one batch holds; a step combining
            more (per counted batch) is refused before anything is released.
        poisson_batches: Poisson batches (``make_private``): one sampled batch per step, split
            only by ``BatchMemoryManager``; ``virtual_step`` and merged passes are refused.
    """

    count_iterations: bool = True
    max_batch_size: Optional[int] = None
    poisson_batches: bool = False

    def __post_init__(self):
        size = self.max_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"max_batch_size must be a positive int or None, got {size!r}")


class LogicalBatchMixin:
    """Virtual steps, skip signals and the size checks of a logical batch, for ``DPOptimizer``
    (its :class:`BatchingPolicy` is ``self.batching``)."""

    @property
    def count_iterations(self) -> bool:
        return self.batching.count_iterations

    @property
    def max_batch_size(self) -> Optional[int]:
        return self.batching.max_batch_size

    @property
    def poisson_batches(self) -> bool:
        return self.batching.poisson_batches

    def virtual_step(self) -> None:
        """Clip and accumulate the current per-sample gradients; no parameter update.

        Everything accumulated until the next ``step()`` is ONE logical batch for the
        accountant (one record): use it to cut a logical batch into physical pieces, never
        to merge several sampled batches (that under-reports ε; draw larger batches instead).
        With the Poisson batches of ``make_private`` it is refused (pieces of one batch and of two
        look alike here): ``BatchMemoryManager`` splits those batches.
        """
        self._refuse_merging_poisson_batches("optimizer.virtual_step()")
        self._accumulate_piece()

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` only accumulates (``True``) or steps (``False``);
        ``True`` is refused with Poisson batches (as :meth:`virtual_step`)."""
        if do_skip:
            self._refuse_merging_poisson_batches("optimizer.signal_skip_step(True)")
        self._skip_signals.append(bool(do_skip))

    def signal_chunk_step(self, do_skip: bool) -> None:
        """:meth:`signal_skip_step` for the pieces of one sampled batch (``BatchMemoryManager``)."""
        self._skip_signals.append(bool(do_skip))

    def _refuse_merging_poisson_batches(self, call: str) -> None:
        if self.poisson_batches:
            raise ValueError(
                f"{call} with Poisson sampling: the optimizer cannot tell the pieces of one sampled "
                "batch from two batches, and two batches merged into one step would be recorded as "
                "one batch of rate q (a sample drawn in both counting twice). Call optimizer.step() "
                "once per batch of the data loader; to split a batch that does not fit in memory, "
                "iterate BatchMemoryManager(data_loader=..., max_physical_batch_size=..., "
                "optimizer=...); for larger batches raise the loader's batch size. No update was made")

    def take_unconsumed_skip_signals(self) -> List[bool]:
        """The signals of :meth:`signal_skip_step` that no ``step()`` consumed (now dropped)."""
        signals = list(self._skip_signals)
        self._skip_signals.clear()
        return signals

    def discard_unfinished_batch(self) -> int:
        """Drop what a logical batch that never reached its step left behind: the clipped sums
        of its earlier pieces, the per-sample state of a backward pass not yet clipped, queued
        skip signals. Nothing of it was released (no noise, no accountant record). Returns
        the number of samples whose clipped gradients were dropped."""
        dropped = self._num_accumulated
        self._drop_accumulated()
        self._skip_signals.clear()
        self.grad_source.clear(self.params)
        return dropped

    def _check_max_batch_size(self) -> None:
        if self.max_batch_size is None:
            return
        limit = self.max_batch_size * self.accumulated_iterations
        if self._num_accumulated > limit:
            raise ValueError(
                f"this step combines {self._num_accumulated} samples, more than one logical batch "
                f"(batch_size={limit}): the accountant would record one batch where several were "
                "used. Make batch_size the logical batch (physical size x accumulation steps) and "
                "split it with virtual_step()/BatchMemoryManager; nothing was updated"
            )

    def _pending_iterations(self) -> int:
        """Batches merged into the coming step by several backward passes (1 if not counted)."""
        if not self.count_iterations:
            return 1
        return max(1, int(self.grad_source.pending_passes()))
