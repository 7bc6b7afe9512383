"""How the pieces of a logical batch reach one private step (the ``DPOptimizer`` side).

Everything accumulated until ``step()`` is ONE logical batch for the accountant (one record):
pieces cut by ``virtual_step()`` / ``signal_skip_step()`` / ``BatchMemoryManager``, or ``k``
backward passes merged without them (counted: the accountant records ``k·q``). With the Poisson
batches of ``make_private`` only ``BatchMemoryManager`` may cut a batch (``signal_chunk_step``),
and a step over more samples than ``max_batch_size`` per merged batch is refused.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from opacus_dp.errors import LogicalBatchOverflowError, PoissonBatchMergeError
from opacus_dp.maths.per_sample import sum_dtype


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


class LogicalBatch:
    """The pieces of the coming step (one per optimizer, under its :class:`BatchingPolicy`): the
    clipped sums ``S_l`` accumulated so far and their sample count, the queued skip signals, the
    backward passes merged into the step, and an earlier piece's failure (distributed runs)."""

    def __init__(self, policy: BatchingPolicy):
        self.policy = policy
        self.sums: Dict[torch.Tensor, torch.Tensor] = {}
        self.num_samples = 0  # accumulated since the last step
        self.last_num_samples = 0  # those of the last step
        self.iterations = 1  # k: the batches merged into the coming step
        self.failed_piece: Optional[Exception] = None
        self._skip_signals = deque()

    # --------------------------------------------------------------- pieces
    def add(self, params: Sequence[torch.Tensor], clipped_sums, num_samples: int) -> None:
        """``S_l += clipped_l`` (in :func:`~opacus_dp.maths.per_sample.sum_dtype`) for one piece."""
        for p, clipped in zip(params, clipped_sums):
            if clipped is not None:
                clipped = clipped.to(sum_dtype(p.dtype))
                self.sums[p] = self.sums[p] + clipped if p in self.sums else clipped
        self.num_samples += num_samples

    def take(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The sums of the step, one per tensor of ``params`` (zeros, full shape, where no sample
        reached it); the batch is empty afterwards."""
        sums = [self.sums[p] if p in self.sums else torch.zeros(p.shape, dtype=sum_dtype(p.dtype), device=p.device)
                for p in params]
        self.sums = {}
        self.last_num_samples, self.num_samples = self.num_samples, 0
        return sums

    def drop(self) -> int:
        """Forget the sums of an unfinished logical batch; the number of samples dropped."""
        dropped = self.num_samples
        self.sums, self.num_samples = {}, 0
        return dropped

    @property
    def unfinished(self) -> bool:
        """Whether pieces wait for their step."""
        return bool(self.sums or self.num_samples)

    def mark_failed(self, error: Exception) -> None:
        """Remember the first failed piece (distributed runs refuse the batch's step everywhere)."""
        if self.failed_piece is None:
            self.failed_piece = error

    def take_failed_piece(self) -> Optional[Exception]:
        failed, self.failed_piece = self.failed_piece, None
        return failed

    # --------------------------------------------------------------- skip signals
    def signal(self, do_skip: bool) -> None:
        self._skip_signals.append(bool(do_skip))

    def skip_next(self) -> bool:
        """Whether the coming ``step()`` only accumulates (consumes one signal)."""
        return bool(self._skip_signals) and self._skip_signals.popleft()

    def take_signals(self) -> List[bool]:
        signals = list(self._skip_signals)
        self._skip_signals.clear()
        return signals

    # --------------------------------------------------------------- checks
    def refuse_merging_poisson_batches(self, call: str) -> None:
        """PoissonBatchMergeError for ``call`` with Poisson batches."""
        if self.policy.poisson_batches:
            raise PoissonBatchMergeError(
                f"{call} with Poisson sampling: the optimizer cannot tell the pieces of one sampled "
                "batch from two batches, and two batches merged into one step would be recorded as "
                "one batch of rate q (a sample drawn in both counting twice). Call optimizer.step() "
                "once per batch of the data loader; to split a batch that does not fit in memory, "
                "iterate BatchMemoryManager(data_loader=..., max_physical_batch_size=..., "
                "optimizer=...); for larger batches raise the loader's batch size. No update was made")

    def count_iterations(self, pending_passes: Callable[[], int]) -> None:
        """``k``: the backward passes merged into the coming step (``pending_passes()``; 1 if not
        counted); refused above 1 with Poisson batches."""
        self.iterations = max(1, int(pending_passes())) if self.policy.count_iterations else 1
        if self.iterations > 1:
            self.refuse_merging_poisson_batches(f"one step over {self.iterations} backward passes")

    def check_size(self) -> None:
        """LogicalBatchOverflowError if the step holds more samples than ``k`` fixed batches."""
        if self.policy.max_batch_size is None:
            return
        limit = self.policy.max_batch_size * self.iterations
        if self.num_samples > limit:
            raise LogicalBatchOverflowError(
                f"this step combines {self.num_samples} samples, more than one logical batch "
                f"(batch_size={limit}): the accountant would record one batch where several were "
                "used. Make batch_size the logical batch (physical size x accumulation steps) and "
                "split it with virtual_step()/BatchMemoryManager; nothing was updated"
            )
