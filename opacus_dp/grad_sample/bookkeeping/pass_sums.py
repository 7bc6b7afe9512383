"""The clipped sums of finished backward passes: ``Σ_i f_i g_i`` per parameter from what each
pass kept (:mod:`~opacus_dp.grad_sample.bookkeeping.bookkeeper`): sums formed during the pass, the
ghost layers' kept calls (weighted gradients, each call's tensors freed once used), privacy units'
sums and materialised per-sample gradients. Passes made before the factors are consumed (virtual
steps) take consecutive windows of the factors' rows."""

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.grouped_units import grouped_clipped_sums, row_factors
from opacus_dp.grad_sample.bookkeeping.passes import Pass, add_to, ghost_weighted_grad
from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import materialise
from opacus_dp.maths.per_sample import weighted_sum
from opacus_dp.module_parameters import own_tensors


def passes_clipped_sums(passes: List[Pass], params: Sequence[torch.Tensor],
                        factors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """``Σ_i f_i g_i`` per param over ``passes`` (None if it has no gradient); empties them."""
    by_param = dict(zip(params, factors))
    sums: Dict[torch.Tensor, torch.Tensor] = {}
    offset = 0
    for resolved in passes:
        rows = resolved.batch_size if resolved.groups is None else resolved.groups.num_units
        window = slice(offset, offset + rows)
        offset += rows
        _check_same_factors(resolved, by_param, window)
        for p, s in resolved.sums.items():
            add_to(sums, p, s)
        resolved.unsettled.clear()
        while resolved.ghost_calls:  # each call's tensors freed once used (memory reused)
            layer, activations, backprops, scale = resolved.ghost_calls.pop()
            wanted = owned_factors(layer, by_param, scale, resolved, window)
            for p, s in ghost_weighted_grad(layer, materialise(activations), backprops,
                                            wanted).items():
                add_to(sums, p, s)
            del activations, backprops
        for p, s in grouped_clipped_sums(resolved, by_param, window).items():
            add_to(sums, p, s)
        for p in list(resolved.grads):
            g = resolved.grads.pop(p)
            if p in by_param:
                add_to(sums, p, weighted_sum(row_factors(resolved, by_param[p][window])
                                             * resolved.grad_scales[p], g))
    return [sums.get(p) for p in params]


def owned_factors(layer: nn.Module, by_param: Dict[torch.Tensor, torch.Tensor], scale: float,
                  resolved: Pass, window: slice = slice(None)) -> Dict:
    """``{p: scale · factors[p][window]}`` for the parameters ``layer`` owns that have norms in
    the pass ``resolved``, but not those kept there as per-sample gradients (summed apart).
    A parameter without norms did not require grad during the backward pass; unfrozen before
    the step, its kept output gradients would otherwise add an unclipped sum."""
    return {p: by_param[p][window] * scale for p in own_tensors(layer)
            if p in by_param and p in resolved.sq_norms and p not in resolved.grads}


def _check_same_factors(resolved: Pass, by_param, window) -> None:
    if resolved.factors is None:
        return
    for p, used in resolved.factors.items():
        if p in by_param and not torch.allclose(by_param[p][window].to(used.dtype), used,
                                                rtol=1e-6, atol=0.0):
            raise RuntimeError(
                "the clip factors changed between loss.backward() and optimizer.step() (was "
                "max_grad_norm changed in between?): the clipped sums computed during the "
                "backward pass (the 'ghost' mode's second pass, or 'bk' with per-layer "
                "clipping) used other factors"
            )
