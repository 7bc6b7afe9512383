"""One ``optimizer.step()`` per Poisson batch, checked as the batches are handed out.

The accountant charges one subsampled Gaussian step per released step at rate ``q``. A batch that
is drawn and gets no step (``if len(x) == 0: continue``, a caught NaN loss) is not charged, yet
whether it was skipped depends on the draw and on the data: an empty draw would have held the
removed example with probability ``q``. So the loader ``make_private`` returns (one process,
independent noise) refuses to hand out the next batch of a pass, or to end the pass, while the
optimizer's released steps (``DPOptimizer.steps_taken``) have not moved since the previous batch
was handed out. Leaving a pass with ``break`` is allowed: the draws not handed out were not used.
``BatchMemoryManager`` checks its logical batches itself; the cyclic Poisson loader of the
correlated mechanisms checks its steps against its schedule.

The classic engine cannot see its loader: attached with ``poisson=True`` in one process, it
follows every live ``DPDataLoader`` of its rate (:func:`follow_live_loaders`), so that Poisson
batches merged into one step with ``virtual_step`` (each an accounted draw of rate ``q``, two of
them a draw of about ``2q`` where an example may count twice) are refused as well.
"""

import math
import weakref
from typing import Iterable, Iterator, List, Optional

_LIVE_LOADERS = weakref.WeakSet()  # the single-process DPDataLoaders (register_loader)


class SkippedBatchError(RuntimeError):
    """A batch of a Poisson loader got no ``optimizer.step()`` (module doc)."""


class StepPerBatch:
    """Follows an optimizer's released steps (``steps_taken``), held weakly so that a loader
    does not keep a dropped model alive; unconnected (or once the optimizer is gone), checks
    nothing."""

    def __init__(self):
        self._optimizer = None

    def follow(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def unfollow(self) -> None:
        self._optimizer = None

    @property
    def connected(self) -> bool:
        return self._optimizer is not None

    def _counter(self) -> Optional[int]:
        optimizer = None if self._optimizer is None else self._optimizer()
        return None if optimizer is None else int(optimizer.steps_taken)

    def checked(self, batches: Iterable, dropped: int = 0) -> Iterator:
        """``batches`` after the first ``dropped`` (drawn again and dropped, e.g. those trained on
        before a checkpoint inside the pass), refusing the next one (or the end of the pass) while
        the previous one has had no step."""
        batches = iter(batches)
        for _ in range(dropped):
            next(batches, None)
        if not self.connected:
            yield from batches
            return
        steps_before = None
        for batch in batches:
            self._check(steps_before)
            steps_before = self._counter()
            yield batch
        self._check(steps_before)

    def _check(self, steps_before: Optional[int]) -> None:
        if steps_before is not None and self._counter() == steps_before:
            raise SkippedBatchError(
                "the private loader: the previous batch of this pass got no optimizer.step() (was an empty "
                "batch skipped with `continue`, or an exception caught and the batch dropped?). The "
                "accountant charges the steps released, and whether a batch was skipped depends on its "
                "draw, so every batch, also an empty one, must end in optimizer.step(): it adds the "
                "noise and is accounted (an empty batch goes through the model and the loss like any "
                "other; a non-finite sample is dropped by the step itself). To stop early, leave the loop "
                "with break; to iterate without training, use the original data loader")


def register_loader(loader) -> None:
    """Note a single-process Poisson loader (``loader.sample_rate``, ``loader.step_per_batch``)
    that :func:`follow_live_loaders` may connect."""
    _LIVE_LOADERS.add(loader)


def follow_live_loaders(optimizer, sample_rate: float) -> List[StepPerBatch]:
    """Connect every live registered loader of rate ``sample_rate`` (equal up to 1e-9 relative)
    that follows no optimizer yet to ``optimizer`` (``steps_taken``); return their checks, for
    :meth:`StepPerBatch.unfollow` when the engine detaches."""
    followed = []
    for loader in list(_LIVE_LOADERS):
        check = loader.step_per_batch
        if not check.connected and math.isclose(float(loader.sample_rate), float(sample_rate), rel_tol=1e-9):
            check.follow(optimizer)
            followed.append(check)
    return followed
