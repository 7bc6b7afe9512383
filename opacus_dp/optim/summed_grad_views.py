"""``p.summed_grad`` of a :class:`~opacus_dp.optim.DPOptimizer`: the clipped sums ``S_l`` shown on
the parameters with one Opacus generation's lifecycle (:mod:`opacus_dp.state_views`)."""

import weakref
from typing import Dict, List, Sequence, Set

import torch

from opacus_dp.state_views import StateViews, remove_views


class SummedGradViews:
    """Shows an optimizer's clipped sums as ``p.summed_grad`` with the lifecycle of ``views``; the
    attributes go with the optimizer ``owner`` (as the wrappers' ``p.grad_sample``)."""

    def __init__(self, views: StateViews, owner, param_groups):
        self.views = views
        self._finalizer = weakref.finalize(owner, remove_views, param_groups, "summed_grad")
        self._finalizer.atexit = False
        self._shown_memory: Set[int] = set()

    def show(self, params: Sequence[torch.Tensor], sums: Dict[torch.Tensor, torch.Tensor]) -> None:
        """``p.summed_grad = sums[p]`` (absent where there is none)."""
        shown = [sums.get(p) for p in params]
        for p, value in zip(params, shown):
            self.views.show(p, "summed_grad", value)
        self._shown_memory = {value.untyped_storage().data_ptr() for value in shown if value is not None}

    def exposes(self, tensor: torch.Tensor) -> bool:
        """True when some ``p.summed_grad`` shown now shares ``tensor``'s memory (the noise must
        then go into a new tensor, not into ``tensor``)."""
        return tensor.untyped_storage().data_ptr() in self._shown_memory

    def show_kept(self, params: Sequence[torch.Tensor], sums: Dict[torch.Tensor, torch.Tensor]) -> None:
        """The accumulated sums, where the lifecycle keeps them after a step (1.x), else none."""
        self.show(params, sums if self.views.keeps_after_step else {})

    def show_step_sums(self, params: Sequence[torch.Tensor], sums: List[torch.Tensor], reducer) -> None:
        """1.x: ``p.summed_grad`` is this rank's clipped sum of the step (copied where the reducer
        overwrites it); not when the reducer shards (FSDP2 frees the full sums as they are sent)."""
        if not self.views.keeps_after_step or reducer.shards:
            return self.show(params, {})
        shown = [s.clone() for s in sums] if reducer.reuses_input else sums
        self.show(params, dict(zip(params, shown)))
