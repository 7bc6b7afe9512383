"""Per-sample gradients of ``nn.Linear``.

For ``y = x W^T + b`` with input ``x_i`` of shape ``(..., in)`` and output gradient
``g_i`` of shape ``(..., out)`` for sample ``i`` (any number of middle dimensions,
e.g. sequence positions), the per-sample gradients sum over those middle dimensions:

    dL_i/dW = sum_t g_i[t]^T x_i[t]      (out, in)
    dL_i/db = sum_t g_i[t]               (out,)
"""

from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.maths.cpu_products import outer_sums
from opacus_dp.grad_sample.support import sum_over_positions


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample ``weight``/``bias`` gradients of ``layer`` (batch on dim 0)."""
    x = activations[0]
    batch_size = x.shape[0]
    x = x.reshape(batch_size, -1, x.shape[-1]).to(backprops.dtype)
    g = backprops.reshape(batch_size, -1, backprops.shape[-1])
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = outer_sums(g, x)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = sum_over_positions(g)
    return grads
