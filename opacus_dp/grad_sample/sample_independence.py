"""Refuse ``torch.func``-fallback layers whose outputs depend on other samples.

The fallback differentiates each sample alone, ``y_i = f(theta, x_i)``, while the loss saw the
batched call ``Y = f(theta, x)``. The per-sample gradients are right exactly when ``Y_i = y_i``
for every ``i``; a layer such as ``(x - x.mean(0)) * w`` has ``Y_i - y_i = -mean(x) * w``, and
its private gradient would be silently wrong.

So on a layer's first call with ``B >= 2`` samples (a batch of one proves nothing: the check
waits for a larger one) the fallback also returns its vmapped per-sample outputs ``y``, and
each output that receives a gradient is compared with a batched recomputation ``Y``::

    max|Y - y|  <=  rtol * max(max|Y|, max|y|),     rtol = max(1e-5, 8 eps)

with ``eps`` the output dtype's (that of TF32 / bf16 for float32 where torch may compute
matmuls or convolutions with them): reordered float reductions stay far below it, mixed
samples are of the order of the outputs. Non-finite values must agree exactly.

Cost: one extra forward of the layer on the batch (without autograd graph) and one output's
memory, once per layer; later calls cost nothing. Random layers (dropout) never reach the
check: the fallback refuses them before (``vmap``'s ``randomness="error"``), so no RNG state is
consumed or forked here. An output without the batch on the layer's batch dimension (other
shape than the stacked per-sample outputs) is not compared.
"""

import weakref
from typing import Any, Dict, List, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_unflatten

from opacus_dp.grad_sample.own_forward import own_forward

_CHECKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class SamplesMixedError(RuntimeError):
    """A layer's batched outputs differ from its per-sample outputs (message: the evidence)."""


def needs_check(layer: nn.Module, batch_size: int) -> bool:
    """True on the layer's calls until one with ``batch_size >= 2`` has passed the check."""
    return batch_size >= 2 and layer not in _CHECKED


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """``rtol = max(1e-5, 8 eps)`` of the precision the layer's arithmetic may really use."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    eps = torch.finfo(dtype).eps
    if dtype in (torch.float32, torch.complex64):
        precision = torch.get_float32_matmul_precision()
        if precision == "medium":
            eps = 2.0 ** -7  # bf16
        elif precision == "high" or (device.type == "cuda" and (
                torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)):
            eps = 2.0 ** -10  # TF32
    return max(1e-5, 8 * eps)


def _batched_outputs(layer, params, leaves, spec, batch_dim: int) -> List[torch.Tensor]:
    """Tensor outputs of the layer called once on the whole batch (its own batch layout)."""
    to_layer = lambda v: v.movedim(0, batch_dim) if (  # noqa: E731
        isinstance(v, torch.Tensor) and batch_dim != 0 and v.dim() > batch_dim) else v
    args, kwargs = tree_unflatten([to_layer(v) for v in leaves], spec)
    with torch.no_grad():
        output = own_forward(layer, params, tuple(args), kwargs)
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]


def relative_gap(batched: torch.Tensor, per_sample: torch.Tensor) -> float:
    """``max|Y - y| / max(max|Y|, max|y|)`` (inf where non-finite values disagree)."""
    wide = torch.promote_types(batched.dtype, torch.float32)
    a, b = batched.detach().to(wide), per_sample.detach().to(wide)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    gap = (a - b).abs().masked_fill(same, 0)
    if gap.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(gap).all()):
        return float("inf")
    finite = lambda t: t.abs().masked_fill(~torch.isfinite(t), 0).max()  # noqa: E731
    scale = torch.maximum(finite(a), finite(b))
    return float(gap.max() / scale) if bool(scale > 0) else float(gap.max())


def check_sample_independence(
    layer: nn.Module,
    params: Dict[str, torch.Tensor],
    leaves: List[Any],
    spec: Any,
    per_sample: Sequence[torch.Tensor],
    output_slots: Sequence[int],
    batch_dim: int,
) -> None:
    """Raise :class:`SamplesMixedError` unless the batched outputs in ``output_slots`` equal the
    stacked per-sample outputs ``per_sample`` (shape ``(B, *output_i)``, size 1 at the layer's
    ``batch_dim``) within :func:`tolerance`; then mark the layer checked.

    ``leaves``/``spec`` are the flattened ``(args, kwargs)`` with the batch on dimension 0.
    """
    batched = _batched_outputs(layer, params, leaves, spec, batch_dim)
    for slot, stacked in zip(output_slots, per_sample):
        full = batched[slot]
        if stacked.dim() < batch_dim + 2 or stacked.shape[batch_dim + 1] != 1:
            continue
        joined = stacked.movedim(0, batch_dim + 1).flatten(batch_dim, batch_dim + 1)
        if joined.shape != full.shape:
            continue
        gap, limit = relative_gap(full, joined), tolerance(full.dtype, full.device)
        if gap > limit:
            raise SamplesMixedError(
                f"tensor output #{slot}: batched and one-sample-at-a-time results differ by "
                f"{gap:.2g} x its largest magnitude, above the tolerance {limit:.1g}")
    _CHECKED.add(layer)
