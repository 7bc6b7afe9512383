"""One backward pass of the book-keeping modes, and how a layer's calls in it are resolved.

See :mod:`opacus_dp.grad_sample.bookkeeping.bookkeeper` for the method. A layer's calls are resolved
either **ghost** (squared norms from the norm sampler, the merged call kept for the weighted
sum; a parameter whose per-sample gradients the norm sampler returned, such as a bias, is
kept as materialised), **materialised** (per-sample gradients, summed over the calls and
layers) or, with per-layer clipping on CPU where the layer type prefers it, **chunked**
(per-sample gradients a few samples at a time, clipped and summed at once:
:mod:`~opacus_dp.grad_sample.bookkeeping.chunked_sums`).
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.chunked_sums import ChunkBuffer, chunked_clipped_sums
from opacus_dp.grad_sample.modification_guard import KeptVersions, changed_before_step
from opacus_dp.grad_sample.bookkeeping.norm_rules import norm_rule_of
from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import RecomputedInput, recomputed_in
from opacus_dp.grad_sample.bookkeeping.norm_samplers.trust import deferred_checks
from opacus_dp.grad_sample.registry import PerSampleGrads
from opacus_dp.module_parameters import holds_canonical, own_tensors, to_canonical, to_live
from opacus_dp.maths.per_sample import (drops_rows, finite_factors, finite_values, per_sample_norms,
                                        sum_dtype, weighted_sum, without_dropped_rows)
from opacus_dp.maths.float32_products import ieee_float32_products

LAYER_RULES = ("mixed", "ghost")
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Call:
    """One call of a hooked layer as the backward hook saw it (tensors batch-first)."""

    layer: nn.Module
    name: str
    call: object  # LayerCall
    backprops: List[Optional[torch.Tensor]]
    scale: float


@dataclass
class Pass:
    """What one backward pass leaves for the optimizer step."""

    batch_size: int
    first_layer: str
    deferred: Dict[nn.Module, List[Call]] = field(default_factory=dict)
    sq_norms: Dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    grads: Dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    grad_scales: Dict[torch.Tensor, float] = field(default_factory=dict)
    ghost_calls: List[Tuple[nn.Module, list, torch.Tensor, float]] = field(default_factory=list)
    ghost_layers: Set[nn.Module] = field(default_factory=set)
    modes: Dict[str, str] = field(default_factory=dict)
    factors: Optional[Dict[torch.Tensor, torch.Tensor]] = None
    sums: Dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    unsettled: List[RecomputedInput] = field(default_factory=list)  # kept inputs still as φ(h)
    kept_versions: List[Tuple[str, KeptVersions]] = field(default_factory=list)  # of ghost_calls
    groups: Optional[object] = None  # UnitGroups of the rows, set at the step when units are grouped
    grouped_calls: List[Tuple[nn.Module, list, torch.Tensor, float]] = field(default_factory=list)
    grouped_params: Set[torch.Tensor] = field(default_factory=set)  # of grouped_calls (norms at the step)
    gradient_shared: Dict[nn.Module, object] = field(default_factory=dict)  # layer: key of its gradient kept elsewhere
    unchecked: List[Tuple[tuple, List[torch.Tensor]]] = field(default_factory=list)  # (ghost_calls entry, suspect masks)

    def changed_kept_call(self) -> Optional[str]:
        """Name of a layer whose kept tensors were written in place since they were kept."""
        return next((name for name, versions in self.kept_versions if versions.changed()), None)


def refuse_changed_kept_calls(passes: List[Pass]) -> None:
    """Raise (consuming nothing) if a tensor kept in ``passes`` for a clipped sum was written in
    place since its backward pass (see :mod:`~opacus_dp.grad_sample.modification_guard`)."""
    for resolved in passes:
        name = resolved.changed_kept_call()
        if name is not None:
            raise changed_before_step(name)


def resolve_calls(current: Pass, layer: nn.Module, calls: List[Call], *, per_sample_grads: Callable,
                  layer_rule: str, shared: bool, keep_ghost_calls: bool,
                  factor_function: Optional[Callable] = None,
                  chunk_buffer: Optional[ChunkBuffer] = None, gradient_shared: bool = False) -> None:
    """Resolve all ``calls`` of ``layer`` in ``current``: ghost, materialised or chunked
    (module doc).

    ``gradient_shared``: another layer's kept calls hold the output gradient too
    (:mod:`~opacus_dp.grad_sample.bookkeeping.step_gradients`), so keeping this call costs only its
    inputs and the ghost path is taken wherever the layer type prefers it.

    ``factor_function(param, norms) -> factors or None``: when it gives the clip factors of
    each of the layer's parameters from that parameter's own norms (per-layer clipping), the
    layer's clipped sums are computed now and nothing else of the call is kept (the factors
    used are recorded in ``current.factors`` and checked at the step); with a
    ``chunk_buffer``, in chunks where the layer type prefers it.
    """
    if factor_function is not None and chunk_buffer is not None and keep_ghost_calls \
            and layer_rule == "mixed" and not shared \
            and _sum_in_chunks(current, layer, calls, factor_function, chunk_buffer):
        current.modes[calls[0].name] = "chunked"
        return
    merged = None if shared else _ghost_call(layer, calls, layer_rule,
                                             keep_ghost_calls and not gradient_shared)
    if merged is None:
        _materialise(current, calls, per_sample_grads)
        current.modes[calls[0].name] = "materialised"
        if factor_function is not None and not shared:
            _sum_materialised_now(current, layer, factor_function)
        return
    activations, backprops, scale = merged
    if keep_ghost_calls and len(calls) > 1:
        _drop_merged_records(calls)
    with deferred_checks(keep_ghost_calls and factor_function is None) as suspect_masks:
        norms = ghost_norms(layer, activations, backprops)
    for p, result in norms.items():
        if isinstance(result, PerSampleGrads):
            _check_new(current, p)
            _add_grads(current, p, result.grads, scale)
            _set_norms(current, p)
        else:
            _add_norms(current, p, result * (scale * scale))
    current.ghost_layers.add(layer)
    current.modes[calls[0].name] = "ghost"
    if not keep_ghost_calls:
        return
    factors = _factors_now(current, layer, factor_function)
    if factors is None:
        if len(calls) == 1:  # kept until the step: hold cheaper inputs where possible
            activations = calls[0].call.kept_activations(layer, activations)
            current.unsettled.extend(recomputed_in(activations))
        current.ghost_calls.append((layer, activations, backprops, scale))
        if suspect_masks:  # norms checked at the step (deferred_checks)
            current.unchecked.append((current.ghost_calls[-1], suspect_masks))
        current.kept_versions.append((calls[0].name, KeptVersions([*activations, backprops])))
        return
    wanted = {p: f * scale for p, f in factors.items() if p not in current.grads}
    for p, s in ghost_weighted_grad(layer, activations, backprops, wanted).items():
        add_to(current.sums, p, s)
    _sum_grads_now(current, {p: f for p, f in factors.items() if p in current.grads})


def _drop_merged_records(calls: List[Call]) -> None:
    """Free the inputs and output gradients of calls merged into one (the merged copy holds what
    the norms and the clipped sum need), before the norms are formed: a layer called at every
    step of a sequence would otherwise hold both its calls and their concatenation."""
    for c in calls:
        c.backprops = [None] * len(c.backprops)
        c.call.release()


def _in_sum_dtype(activations: list, backprops: torch.Tensor):
    """Half-precision inputs and output gradients as float32 (exactly), so that a ghost layer's
    norms and its clipped sum both come from float32 products and agree to float32 rounding
    (half-precision products would leave a clipped sample up to ~2⁻⁸ above the bound).

    Under autocast a ``Linear``/``Conv`` computes in half precision from float32 inputs: the
    output gradient is half precision, and the weight gradient is that of the *rounded* inputs.
    Inputs more precise than the output gradient are therefore rounded to its dtype first, so
    norms and sums are those of the gradient autograd forms, whichever path (merged calls,
    two-pass sums) reaches them."""
    half = backprops.dtype in HALF_DTYPES
    if not half and not any(isinstance(a, torch.Tensor) and a.dtype in HALF_DTYPES for a in activations):
        return list(activations), backprops  # nothing to lift (float32/float64, integer inputs)

    def lift(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        if half and t.dtype != backprops.dtype:
            t = t.to(backprops.dtype)
        return t.to(sum_dtype(t.dtype))
    return [lift(a) for a in activations], lift(backprops)


def ghost_norms(layer: nn.Module, activations: list, backprops: torch.Tensor) -> Dict:
    """The layer's norm sampler, on float32 inputs for half-precision ones, with IEEE float32
    products (:mod:`~opacus_dp.maths.float32_products`)."""
    activations, backprops = _in_sum_dtype(activations, backprops)
    with ieee_float32_products(backprops.device):
        return to_canonical(layer, norm_rule_of(layer).norm_sampler(layer, activations, backprops))


def ghost_weighted_grad(layer: nn.Module, activations: list, backprops: torch.Tensor,
                        factors: Dict[torch.Tensor, torch.Tensor], drops: Optional[bool] = None) -> Dict:
    """The layer's ``Σ_i f_i g_i``, on float32 inputs for half-precision ones, with IEEE float32
    products. ``drops``: whether some factor is 0 or non-finite (None: as
    :func:`~opacus_dp.maths.per_sample.drops_rows` tells); then :func:`_without_dropped_samples`."""
    activations, backprops = _in_sum_dtype(activations, backprops)
    if drops is None:
        drops = any(drops_rows(f) for f in factors.values())
    factors = to_live(layer, factors)  # keyed by canonical tensors; the rules use the layer's own
    with ieee_float32_products(backprops.device):
        if drops:
            return to_canonical(layer, _without_dropped_samples(layer, activations, backprops, factors))
        return to_canonical(layer, norm_rule_of(layer).weighted_grad(layer, activations, backprops, factors))


def _without_dropped_samples(layer: nn.Module, activations: list, backprops: torch.Tensor,
                             factors: Dict[torch.Tensor, torch.Tensor]) -> Dict:
    """The weighted gradient of each parameter on its own, with the output-gradient rows of the
    samples it drops (factor 0 or non-finite) zeroed, and every NaN/inf input value set to 0
    (``0 · NaN = NaN``). The inputs need no rows (they need not be batch-first): an input value a
    sample's gradient uses, if NaN/inf, makes its norm NaN/inf, so the sample is dropped."""
    weighted_grad = norm_rule_of(layer).weighted_grad
    activations = [finite_values(a) for a in activations]
    sums = {}
    for p, f in factors.items():
        f, g = without_dropped_rows(f, backprops)
        sums.update({q: s for q, s in weighted_grad(layer, activations, g, {p: f}).items() if q is p})
    return sums


def _factors_now(current: Pass, layer: nn.Module,
                 factor_function: Optional[Callable]) -> Optional[Dict[torch.Tensor, torch.Tensor]]:
    """Clip factors of the layer's resolved parameters from their own norms, or None."""
    if factor_function is None:
        return None
    factors = {}
    for p in (q for q in own_tensors(layer) if q in current.sq_norms):
        f = factor_function(p, current.sq_norms[p].clamp(min=0).sqrt())
        if f is None:
            return None
        factors[p] = finite_factors(f)  # a NaN norm's factor: 0, the sample dropped
    if current.factors is None:
        current.factors = {}
    current.factors.update(factors)
    return factors


def _sum_materialised_now(current: Pass, layer: nn.Module, factor_function: Callable) -> None:
    """The clipped sums of a materialised layer with known factors; its gradients are dropped."""
    _sum_grads_now(current, _factors_now(current, layer, factor_function) or {})


def _sum_grads_now(current: Pass, factors: Dict[torch.Tensor, torch.Tensor]) -> None:
    """``Σ_i f_i g_i`` of per-sample gradients in the pass, for the ``factors`` given; dropped."""
    for p, f in factors.items():
        g = current.grads.pop(p)
        add_to(current.sums, p, weighted_sum(f * current.grad_scales.pop(p), g))


def add_to(sums: Dict[torch.Tensor, torch.Tensor], p: torch.Tensor, value: torch.Tensor) -> None:
    """``sums[p] += value`` (``value`` itself if ``p`` has no entry yet)."""
    previous = sums.get(p)
    sums[p] = value if previous is None else previous + value


def _merged_call(layer: nn.Module, calls: List[Call], spec):
    """``(activations, backprops, scale)`` of the layer's calls as one, or None if they do not
    merge (``spec``: the layer type's ``NormRule``)."""
    if any(c.backprops[0] is None or c.scale != calls[0].scale for c in calls):
        return None
    pairs = [(c.call.activations(layer), c.backprops[0]) for c in calls]
    if len(pairs) > 1:
        merged = spec.merge_calls(layer, pairs) if spec.merge_calls is not None else None
        if merged is None:
            return None
        pairs = [merged]
    activations, backprops = pairs[0]
    return activations, backprops, calls[0].scale


def _sum_in_chunks(current: Pass, layer: nn.Module, calls: List[Call], factor_function: Callable,
                   buffer: ChunkBuffer) -> bool:
    """The layer's norms, factors and clipped sums from chunked per-sample gradients, if its
    type prefers that for these calls on CPU and each of its parameters has factors of its
    own; False (nothing done) otherwise."""
    spec = norm_rule_of(layer)
    if spec is None or spec.chunk_grads is None or spec.prefers_chunks is None \
            or not holds_canonical(layer):  # FSDP2's unsharded tensors: the other paths re-key
        return False
    merged = _merged_call(layer, calls, spec)
    if merged is None:
        return False
    activations, backprops, scale = merged
    if backprops.device.type != "cpu" or backprops.shape[0] == 0 \
            or not spec.prefers_chunks(layer, activations):
        return False
    activations, backprops = _in_sum_dtype(activations, backprops)
    params, grads, whole = spec.chunk_grads(layer, activations, backprops)
    probe = backprops.new_ones(1)
    if not params or any(factor_function(p, probe) is None for p in [*params, *whole]):
        return False
    for p in [*params, *whole]:
        _check_new(current, p)
    sq_norms, factors, sums = chunked_clipped_sums(params, grads, whole, backprops.shape[0], scale,
                                                   factor_function, buffer, backprops.dtype,
                                                   backprops.device)
    current.sq_norms.update(sq_norms)
    current.factors = {**(current.factors or {}), **factors}
    for p, s in sums.items():
        add_to(current.sums, p, s)
    return True


def _ghost_call(layer: nn.Module, calls: List[Call], layer_rule: str, keeps_calls: bool):
    """``(activations, backprops, scale)`` of the layer's calls as one, if it goes ghost
    (``keeps_calls``: the ghost path would keep them for the clipped sum)."""
    spec = norm_rule_of(layer)
    if spec is None or not spec.has_ghost_path:
        return None
    merged = _merged_call(layer, calls, spec)
    if merged is None:
        return None
    activations, backprops, _ = merged
    if layer_rule == "mixed":
        if spec.prefers_ghost is not None and not spec.prefers_ghost(layer, activations):
            return None
        if keeps_calls and spec.materialise_if_kept is not None \
                and spec.materialise_if_kept(layer, activations):
            return None
    return merged


def _materialise(current: Pass, calls: List[Call], per_sample_grads: Callable) -> None:
    """Per-sample gradients of the calls, added to the pass (norms computed from the sum).

    A single call's gradients are kept as the sampler returned them, with the loss-reduction
    scale in ``grad_scales`` (applied to the norms and the clip factors: no scaled copy)."""
    touched: Dict[torch.Tensor, None] = {}  # keyed by identity, in order
    for c in calls:
        for p, g in per_sample_grads(c.layer, c.call, c.backprops).items():
            _add_grads(current, p, g, c.scale)
            touched[p] = None
    for p in touched:
        _set_norms(current, p)


def _add_grads(current: Pass, p: torch.Tensor, g: torch.Tensor, scale: float) -> None:
    """Add the per-sample gradients ``scale · g`` of ``p`` to the pass."""
    if p in current.sq_norms and p not in current.grads:
        raise RuntimeError(f"parameter of shape {tuple(p.shape)} resolved twice in one pass")
    previous = current.grads.get(p)
    if previous is None:
        current.grads[p], current.grad_scales[p] = g, scale
    else:
        current.grads[p] = previous * current.grad_scales[p] + g * scale
        current.grad_scales[p] = 1.0


def _set_norms(current: Pass, p: torch.Tensor) -> None:
    """The squared norms of ``p``'s per-sample gradients in the pass."""
    current.sq_norms[p] = per_sample_norms(current.grads[p]).square_().mul_(current.grad_scales[p] ** 2)


def _add_norms(current: Pass, p: torch.Tensor, sq: torch.Tensor) -> None:
    _check_new(current, p)
    current.sq_norms[p] = sq


def _check_new(current: Pass, p: torch.Tensor) -> None:
    if p in current.sq_norms or p in current.grads:
        raise RuntimeError(f"parameter of shape {tuple(p.shape)} resolved twice in one pass")


def shared_layers(layers: List[nn.Module]) -> Set[nn.Module]:
    """Layers owning a trainable parameter that another of ``layers`` also owns (tied weights)."""
    owners: Dict[int, List[nn.Module]] = {}
    for layer in layers:
        for p in own_tensors(layer):
            if p.requires_grad:
                owners.setdefault(id(p), []).append(layer)
    return {layer for group in owners.values() if len(group) > 1 for layer in group}
