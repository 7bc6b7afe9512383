"""Generic per-sample gradients with ``torch.func`` for layers without a dedicated sampler.

For a layer ``f(theta, x)`` and the gradient ``g`` of the loss w.r.t. its output, the
per-sample gradient of sample ``i`` is (vector-Jacobian product, exact for any layer whose
output row ``i`` depends only on input row ``i``):

    dL_i/dtheta = d/dtheta  sum( f(theta, x_i) * g_i )

computed for all ``i`` at once with ``vmap(grad(.))`` over the batch. The layer's own forward
(:func:`~opacus_dp.grad_sample.own_forward.own_forward`) runs on a batch of one sample (the batch
dimension is restored at the layer's own batch position), with every tensor argument -- positional or keyword --
batched along dimension 0 and non-tensor arguments passed through unchanged. Outputs may
be any nest of tensors; ``backprops`` lists one gradient (or None) per tensor leaf
(non-tensor leaves are not counted).
Random operations inside the layer (e.g. dropout) raise inside ``vmap`` by design: a
recomputed random forward would not reproduce the gradient.
The formula needs ``f(theta, x)_i = f(theta, x_i)``: on a layer's first call with two samples or
more, its per-sample outputs are compared with the batched ones and a layer whose outputs depend
on other samples is refused (see :mod:`~opacus_dp.grad_sample.sample_independence`).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.func import grad, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample.own_forward import own_forward
from opacus_dp.grad_sample.sample_independence import (
    SamplesMixedError,
    check_sample_independence,
    needs_check,
)

Backprops = Union[torch.Tensor, Sequence[Optional[torch.Tensor]]]


def _per_sample_objective(layer, leaves, spec, tensor_slots, output_slots, batch_dim, keep_outputs):
    """``(params, sample tensors, sample backprops) -> (sum(f(params, x_i) * g_i), aux)``;
    ``aux``: the outputs in ``output_slots`` if ``keep_outputs`` (for the independence check)."""

    def objective(params, sample_tensors, sample_backprops):
        filled = list(leaves)
        for slot, tensor in zip(tensor_slots, sample_tensors):
            filled[slot] = tensor.unsqueeze(batch_dim)
        args, kwargs = tree_unflatten(filled, spec)
        output = own_forward(layer, params, tuple(args), kwargs)
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        total = 0
        for slot, backprop in zip(output_slots, sample_backprops):
            total = total + (outputs[slot] * backprop.unsqueeze(batch_dim)).sum()
        kept = [outputs[slot].detach() for slot in output_slots] if keep_outputs else []
        return total, kept

    return objective


def _trainable_tensors(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """The layer's own trainable parameters by name (for an ``nn.DataParallel`` replica:
    the parameter copies it keeps as plain attributes, listed in ``_former_parameters``)."""
    own: Dict[str, Any] = dict(layer.named_parameters(recurse=False))
    own.update(getattr(layer, "_former_parameters", None) or {})
    return {n: t for n, t in own.items() if t is not None and t.requires_grad}


def _explicit_cell_state(layer: nn.Module, activations: List[Any], kwargs: Dict[str, Any]):
    """An ``nn.RNNCell``/``GRUCell``/``LSTMCell`` called without a state (``hx`` omitted or
    None) starts from zeros; that state, created inside ``vmap``, would be unbatched and
    torch's fused cell kernels refuse it. Pass the zeros explicitly, batched like the input."""
    if not isinstance(layer, nn.RNNCellBase) or not activations:
        return activations, kwargs
    given = activations[1] if len(activations) > 1 else kwargs.get("hx")
    x = activations[0]
    if given is not None or not isinstance(x, torch.Tensor) or x.dim() != 2:
        return activations, kwargs
    zeros = x.new_zeros(x.shape[0], layer.hidden_size)
    state = (zeros, zeros.clone()) if isinstance(layer, nn.LSTMCell) else zeros
    rest = {k: v for k, v in kwargs.items() if k != "hx"}
    return [x, state, *activations[2:]], rest


def functorch_grad_sample(
    layer: nn.Module,
    activations: List[Any],
    backprops: Backprops,
    kwargs: Optional[Dict[str, Any]] = None,
    batch_dim: int = 0,
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of ``layer``'s own trainable parameters (batch on dim 0).

    ``batch_dim`` is where ``layer`` itself expects the batch (1 for sequence-first
    layers); inputs and backprops given here always carry it on dimension 0.
    """
    params = _trainable_tensors(layer)
    if not params:
        return {}
    if isinstance(backprops, torch.Tensor):
        backprops = [backprops]
    output_slots = [i for i, g in enumerate(backprops) if g is not None]
    sample_backprops = [backprops[i] for i in output_slots]
    activations, kwargs = _explicit_cell_state(layer, list(activations), dict(kwargs or {}))
    leaves, spec = tree_flatten((activations, kwargs))
    tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    sample_tensors = [leaves[i] for i in tensor_slots]
    check = bool(sample_backprops) and needs_check(layer, sample_backprops[0].shape[0])
    objective = _per_sample_objective(layer, leaves, spec, tensor_slots, output_slots, batch_dim, check)
    detached = {n: p.detach() for n, p in params.items()}
    sample_backprops, factors = _within_float16(sample_backprops)
    per_sample, outputs = vmap(grad(objective, has_aux=True), in_dims=(None, 0, 0))(
        detached, sample_tensors, sample_backprops
    )
    if check:
        check_sample_independence(layer, detached, leaves, spec, outputs, output_slots, batch_dim)
    return {params[n]: _rescaled(per_sample[n], factors) for n in params}


# Under float16 autocast, the largest entry of a sample's output gradient after the rescaling:
# room (×2⁸) for the layer's own backward products, e.g. sums over positions.
FLOAT16_PEAK_EXPONENT = 7


def _within_float16(backprops: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """``(g_i / k_i, k)`` under float16 autocast (else ``(g, None)``), ``k_i = 2^e_i ≥ 1`` the least
    power of two with ``max|g_i| / k_i ≤ 2^FLOAT16_PEAK_EXPONENT``.

    The recomputed forward runs in float16, so its backward casts the output gradient to float16:
    a scaled loss with the mean undone (``s · ∂ℓ_i/∂out``, up to ``2¹⁶``) would overflow there.
    The per-sample gradient is linear in ``g_i``, so ``k_i · ∇(f · g_i/k_i)`` is the same, and a
    power of two changes no float16 rounding short of the subnormal range. ``k_i = 1`` for a
    sample already within range; a non-finite ``g_i`` stays non-finite (its sample is dropped)."""
    if not backprops or not _float16_autocast(backprops[0].device.type) or backprops[0].shape[0] == 0:
        return backprops, None
    rows = [g.reshape(g.shape[0], -1) for g in backprops]
    peaks = torch.stack([r.abs().amax(dim=1).to(torch.float32) for r in rows if r.shape[1]]
                        or [rows[0].new_zeros(rows[0].shape[0], dtype=torch.float32)]).amax(dim=0)
    factors = torch.exp2(torch.clamp(torch.ceil(torch.log2(peaks)) - FLOAT16_PEAK_EXPONENT, min=0))
    if not bool((factors != 1).any()):
        return backprops, None
    return [g / factors.view(-1, *[1] * (g.dim() - 1)).to(g.dtype) for g in backprops], factors


def _rescaled(per_sample: torch.Tensor, factors: Optional[torch.Tensor]) -> torch.Tensor:
    """``k_i · per_sample_i`` (:func:`_within_float16`), in float32 for a half-precision result."""
    if factors is None:
        return per_sample
    dtype = torch.float32 if per_sample.dtype in (torch.float16, torch.bfloat16) else per_sample.dtype
    return per_sample.to(dtype) * factors.view(-1, *[1] * (per_sample.dim() - 1)).to(dtype)


def _float16_autocast(device_type: str) -> bool:
    """Whether float16 autocast is in effect on ``device_type`` now."""
    try:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        cpu = device_type == "cpu"
        enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    return enabled and dtype == torch.float16


_KNOWN_FAILURES = (  # (words of torch's error, what the layer did, the way out)
    ("random operation", "calls a random operation (e.g. dropout) in its forward pass, which the "
     "fallback's per-sample recomputation cannot reproduce",
     "apply the random operation outside this module (in its parent), or register a grad sampler for it"),
    ("mutate a captured tensor", "writes in place to a tensor it does not compute from its inputs (e.g. "
     "updates a buffer) in its forward pass",
     "keep such state outside the private model (a buffer updated from the batch would be released "
     "without noise), or register a grad sampler for it"),
)


def explained_fallback_error(error: RuntimeError, layer_name: str) -> Exception:
    """A ``ValueError`` naming the layer, what it did and the fix, for the ``torch.func`` failures
    a layer's forward pass causes; other errors are returned unchanged."""
    if isinstance(error, SamplesMixedError):
        return UnsupportedModuleError(
            f"{layer_name} gets per-sample gradients from the generic torch.func fallback, which "
            f"computes each sample alone, but its outputs depend on other samples of the batch "
            f"({error}), so its per-sample gradients would be wrong. Make the layer per-sample "
            f"(e.g. statistics over each sample's own features, GroupNorm/LayerNorm, instead of "
            f"batch statistics), or register a grad sampler for its type "
            f"(opacus_dp.grad_sample.register_grad_sampler)")
    text = str(error).lower()
    for words, cause, fix in _KNOWN_FAILURES:
        if words in text:
            return ValueError(f"{layer_name} gets per-sample gradients from the generic torch.func "
                              f"fallback but {cause}; {fix}")
    return error


def check_fallback_inputs(layer_name: str, master: nn.Module, call) -> None:
    """Refuse a fallback layer called without tensors, or with a tensor not batched like its
    output (``call``: its :class:`~opacus_dp.grad_sample.layer_call.LayerCall`)."""
    args, kwargs = call.batch_first_inputs()
    if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves((list(args), kwargs))):
        raise ValueError(
            f"{layer_name} gets per-sample gradients from the generic torch.func "
            f"fallback but was called without tensor arguments, so its output does not come "
            f"from the samples (its first dimension, {call.batch_size}, would be taken for the "
            f"batch). Compute the parameter's use inside the module that receives the batch, "
            f"or register a grad sampler for {type(master).__name__}."
        )
    for position, leaf in enumerate(tree_leaves((list(args), kwargs))):
        if isinstance(leaf, torch.Tensor) and (
            leaf.dim() == 0 or leaf.shape[0] != call.batch_size
        ):
            raise ValueError(
                f"{layer_name} gets per-sample gradients from the generic "
                f"torch.func fallback, which needs every tensor argument batched with "
                f"{call.batch_size} rows on the batch dimension, but tensor argument "
                f"#{position} has shape {tuple(leaf.shape)}. Keep shared tensors as "
                f"buffers of the module, or register a grad sampler for "
                f"{type(master).__name__}."
            )

