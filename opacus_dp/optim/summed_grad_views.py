"""``p.summed_grad`` of a :class:`~opacus_dp.optim.DPOptimizer`: the clipped sums ``S_l`` shown on
the parameters with one Opacus generation's lifecycle (:mod:`opacus_dp.state_views`)."""

import weakref
from typing import Dict, List

import torch

from opacus_dp.state_views import StateViews, remove_views


class SummedGradViewsMixin:
    """Shows the optimizer's clipped sums as ``p.summed_grad`` (needs ``params``,
    ``original_optimizer`` and ``reducer``)."""

    def use_state_views(self, views: StateViews) -> None:
        """Show ``p.summed_grad`` with the lifecycle of ``views`` (:mod:`opacus_dp.state_views`);
        the attributes go with the optimizer (as the wrappers' ``p.grad_sample``)."""
        self.state_views = views
        self._show_summed({})
        if getattr(self, "_views_finalizer", None) is None:
            self._views_finalizer = weakref.finalize(self, remove_views, self.original_optimizer.param_groups,
                                                     "summed_grad")
            self._views_finalizer.atexit = False

    def _show_step_sums(self, sums: List[torch.Tensor]) -> None:
        """1.x: ``p.summed_grad`` is this rank's clipped sum of the step (copied where the
        all-reduce will overwrite it: a rank that adds no noise reduces its sums in place); not
        under FSDP2, whose full-size sums are freed as soon as they are reduce-scattered."""
        if not self.state_views.keeps_after_step or self.reducer.noises_shards:  # FSDP2: freed as sent
            return self._show_summed({})
        shown = [s.clone() for s in sums] if self.reducer.reduces_in_place and not self.reducer.adds_noise else sums
        self._show_summed(dict(zip(self.params, shown)))

    def _show_summed(self, sums: Dict[torch.Tensor, torch.Tensor]) -> None:
        """``p.summed_grad = sums[p]`` (absent where there is none; :mod:`opacus_dp.state_views`)."""
        for p in self.params:
            self.state_views.show(p, "summed_grad", sums.get(p))
