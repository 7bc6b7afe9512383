"""The step of an empty Poisson draw that never became a batch (see :mod:`.empty_draws`).

For an engine whose optimizer's loop only sees the non-empty draws of a skipping
``UniformWithReplacementSampler`` (Opacus 0.x's loader): :func:`follow_empty_draws` makes every
empty draw of rate q one private step of that optimizer, taken when the sampler draws it
(inside ``next(loader)``, before the next batch is handed out). Such a step is what a batch with
no sample gives: clipped sum 0, Gaussian noise of std ``σ · C``, divided like any step (the
``mean`` reduction: by the expected batch size), the inner optimizer's update, and the step
hooks (the accountant records ``(σ, q)``; the budget guard runs before it). ``p.grad`` is left
as it was before that step.
"""

import weakref
from typing import List, Optional, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from opacus_dp.data.empty_draws import follow_empty_draws_of_rate
from opacus_dp.maths.per_sample import sum_dtype
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind


class NoSamples:
    """A per-sample gradient source (:class:`~opacus_dp.per_sample_source.GradSource`) holding
    one backward pass over zero samples."""

    forms_sums_in_backward = False

    def per_sample_norms(self, params: Sequence[torch.Tensor], name_of=None) -> List[torch.Tensor]:
        return [torch.zeros(0, device=p.device, dtype=sum_dtype(p.dtype)) for p in params]

    def clipped_sums(self, params, factors) -> List[Optional[torch.Tensor]]:
        return [None] * len(params)

    def pending_passes(self) -> int:
        return 1

    def set_factor_function(self, factor_function) -> None:
        """Nothing to clip."""

    def clear(self, params) -> None:
        """Nothing held."""


def take_empty_step(optimizer) -> None:
    """One private step of ``optimizer`` (a DPOptimizer, or an optimizer a classic engine is
    attached to) on a batch of zero samples (module doc)."""
    dp_optimizer = dp_optimizer_behind(optimizer)
    if dp_optimizer is None:
        raise TypeError(f"optimizer must be a DPOptimizer or attached to a PrivacyEngine, got "
                        f"{type(optimizer).__name__}")
    if dp_optimizer.reducer.world_size > 1:
        raise RuntimeError(
            "an empty Poisson draw of one process cannot be a step of all processes (the others "
            "would wait for it in the all-reduce): with several processes sample with "
            "DistributedPoissonBatchSampler (or DPDataLoader(distributed=True)), which yields "
            "empty batches on every rank in step")
    params = list(dp_optimizer.params)
    grads = [p.grad for p in params]
    try:
        with dp_optimizer.reading_from(NoSamples()):
            optimizer.step()
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def follow_empty_draws(optimizer, *, sample_rate: float) -> RemovableHandle:
    """Take :func:`take_empty_step` on ``optimizer`` for every empty draw of a skipping Poisson
    sampler of rate ``sample_rate``, until ``handle.remove()`` (or ``optimizer`` is gone)."""
    target = weakref.ref(optimizer)
    handle: Optional[RemovableHandle] = None

    def on_empty_draw(sampler) -> bool:
        current = target()
        if current is None:
            handle.remove()
            return False
        take_empty_step(current)
        return True

    handle = follow_empty_draws_of_rate(sample_rate, on_empty_draw)
    return handle
