"""Per-sample gradients of ``nn.Embedding``.

For indices ``x_i`` (any shape) and output gradient ``g_i[t]`` of position ``t`` of
sample ``i``, the weight gradient scatters each position's gradient to its row:

    dL_i/dW[v] = sum_{t : x_i[t] = v, v != padding_idx}  g_i[t] * s_i[v]

with ``s_i[v] = 1``, or ``1 / #{t : x_i[t] = v}`` when ``scale_grad_by_freq=True``
(frequencies counted inside sample ``i``, as a batch of that sample alone would do).
Layers with ``max_norm`` or ``sparse=True`` are refused by ``GradSampleModule``.
"""

from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.maths.huge_pages import zeros_on_huge_pages


def sample_row_index(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Index ``i * num_rows + v`` of row ``v`` of sample ``i`` in a ``(B*V, ...)`` table."""
    batch = torch.arange(indices.shape[0], device=indices.device).view(-1, *[1] * (indices.dim() - 1))
    return indices + batch * num_rows


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(
    layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``layer.weight`` (batch on dim 0)."""
    if not layer.weight.requires_grad:
        return {}
    indices = activations[0]
    batch_size = indices.shape[0]
    num_rows, dim = layer.weight.shape
    rows = sample_row_index(indices.reshape(batch_size, -1), num_rows).reshape(-1)
    grads = backprops.reshape(-1, dim)
    scale = torch.ones(rows.shape, dtype=grads.dtype, device=grads.device)
    if layer.padding_idx is not None:
        scale = scale * (indices.reshape(-1) != layer.padding_idx).to(grads.dtype)
    if layer.scale_grad_by_freq:
        counts = torch.bincount(rows, minlength=batch_size * num_rows)
        scale = scale / counts[rows].to(grads.dtype)
    grad_sample = zeros_on_huge_pages((batch_size * num_rows, dim), grads.dtype, grads.device)
    grad_sample.index_add_(0, rows, grads * scale.unsqueeze(1))
    return {layer.weight: grad_sample.view(batch_size, num_rows, dim)}
