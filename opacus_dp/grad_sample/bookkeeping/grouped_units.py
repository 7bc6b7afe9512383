"""The norms-only modes (``ghost`` / ``bk``) with privacy units of several rows (users, augmented
examples: :mod:`opacus_dp.maths.unit_groups`).

A unit's gradient ``G_u = Σ_{i∈u} w_i g_i`` has a norm that per-row norms cannot give, and the rows'
grouping is known only at the step (the loader's, :class:`~opacus_dp.maths.unit_groups.UnitChannel`).
So a layer's calls are kept and the norms formed at the step:

* ``nn.Linear`` on the ghost path: ``g_i = Σ_t b_it a_itᵀ`` is a sum over the row's positions, so
  ``G_u = Σ_{i∈u, t} (w_i b_it) a_itᵀ`` is the gradient of *one* sample whose positions are those of
  all of u's rows: the inputs and weighted output gradients are laid out per unit as
  ``(U, n_max·T, ·)`` (rows of a smaller unit padded with zero output gradients, which add nothing)
  and the layer's norm sampler runs on them — Gram products ``(n_max·T)²(d+p)`` restricted to the
  unit's rows, or the unit's gradient materialised, whichever its cost rule prefers. The clipped sum
  is the layer's weighted gradient with the row factors ``f_{u(i)} w_i``;
* every other layer: per-row gradients materialised, summed per unit for the norms.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.passes import (Call, Pass, _ghost_call, _in_sum_dtype, _materialise,
                                                      ghost_norms, ghost_weighted_grad)
from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.grad_sample.registry import PerSampleGrads
from opacus_dp.grad_sample.modification_guard import KeptVersions
from opacus_dp.maths.per_sample import per_sample_norms, sum_dtype
from opacus_dp.module_parameters import own_tensors


def resolve_grouped(current: Pass, layer: nn.Module, calls: List[Call], *, per_sample_grads: Callable,
                    layer_rule: str, shared: bool) -> None:
    """Keep the layer's calls for norms per unit at the step (module doc)."""
    merged = None if shared or formula_class(layer) is not nn.Linear else _ghost_call(layer, calls, layer_rule, True)
    if merged is None:
        _materialise(current, calls, per_sample_grads)
        current.modes[calls[0].name] = "materialised"
        return
    activations, backprops, scale = merged
    current.grouped_calls.append((layer, activations, backprops, scale))
    current.grouped_params.update(p for p in own_tensors(layer) if p.requires_grad)
    current.kept_versions.append((calls[0].name, KeptVersions([*activations, backprops])))
    current.ghost_layers.add(layer)
    current.modes[calls[0].name] = "ghost"


def row_factors(resolved: Pass, factors: torch.Tensor) -> torch.Tensor:
    """The factors of the pass's rows: its units' factors spread over their rows, if grouped."""
    return factors if resolved.groups is None else resolved.groups.row_factors(factors)


def unit_layout(a: torch.Tensor, b: torch.Tensor, groups) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``a (B, *pos, d)`` and weighted output gradients ``w_i · b (B, *pos, p)`` laid out per
    unit as ``(U, n_max · T, ·)`` (``T`` = positions of a row), zero output gradients as padding."""
    (a,), b = _in_sum_dtype([a], b)  # weighted in float32: the norms and sums see the same values
    rows = a.shape[0]
    a2, b2 = a.reshape(rows, -1, a.shape[-1]), b.reshape(rows, -1, b.shape[-1])
    b2 = b2 * groups.weights.to(b2.device, b2.dtype).view(-1, 1, 1)
    index = groups.index.to(a.device)
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=groups.num_units)
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(rows, device=a.device) - starts[index[order]]
    n_max = int(counts.max()) if rows else 1
    units_a = a2.new_zeros((groups.num_units, n_max, *a2.shape[1:]))
    units_b = b2.new_zeros((groups.num_units, n_max, *b2.shape[1:]))
    units_a[index[order], slots] = a2[order]
    units_b[index[order], slots] = b2[order]
    return (units_a.reshape(groups.num_units, -1, a2.shape[-1]),
            units_b.reshape(groups.num_units, -1, b2.shape[-1]))


def _grouped_call_norms(resolved: Pass) -> Dict[torch.Tensor, torch.Tensor]:
    """``‖G_u‖²`` of the parameters of the pass's kept Linear calls (module doc)."""
    norms = {}
    for layer, activations, backprops, scale in resolved.grouped_calls:
        units_a, units_b = unit_layout(activations[0], backprops, resolved.groups)
        for p, result in ghost_norms(layer, [units_a], units_b).items():
            sq = per_sample_norms(result.grads).square() if isinstance(result, PerSampleGrads) else result
            norms[p] = sq * (scale * scale)
    return norms


def grouped_sq_norms(passes: List[Pass], params: Sequence[torch.Tensor], units) -> List[torch.Tensor]:
    """``‖Σ_{i∈u} w_i g_i‖²`` per privacy unit ``u`` of every pass (concatenated); each pass takes
    its grouping from ``units`` (the channel) first."""
    for resolved, groups in zip(passes, units.take([r.batch_size for r in passes])):
        resolved.groups = groups
    per_pass = [_grouped_call_norms(r) for r in passes]
    result = []
    for p in params:
        parts = []
        for r, kept in zip(passes, per_pass):
            g = r.grads.get(p)
            if g is not None:
                parts.append(r.groups.sq_norms(g.to(sum_dtype(p.dtype))) * r.grad_scales[p] ** 2)
            else:
                parts.append(kept.get(p, torch.zeros(r.groups.num_units, device=p.device, dtype=sum_dtype(p.dtype))))
        result.append(torch.cat(parts) if parts else torch.zeros(0, device=p.device, dtype=p.dtype))
    return result


def grouped_clipped_sums(resolved: Pass, by_param: Dict[torch.Tensor, torch.Tensor], window: slice) -> Dict:
    """``Σ_i f_{u(i)} w_i g_i`` of the pass's kept Linear calls (each freed once used)."""
    sums: Dict[torch.Tensor, torch.Tensor] = {}
    while resolved.grouped_calls:
        layer, activations, backprops, scale = resolved.grouped_calls.pop()
        wanted = {p: row_factors(resolved, by_param[p][window]) * scale for p in own_tensors(layer)
                  if p in by_param and p in resolved.grouped_params}
        for p, s in ghost_weighted_grad(layer, activations, backprops, wanted).items():
            sums[p] = s if p not in sums else sums[p] + s
        del activations, backprops
    return sums
