"""Ghost norms and weighted gradients of ``nn.Conv1d/2d/3d``.

A convolution with ``G`` groups is, per group, a Linear layer applied at every output
position to the unfolded input patch: with ``A_i`` (``T × d``, ``d = C/G · Π k``) the patches of
sample ``i`` and ``G_i`` (``T × p``, ``p = O/G``) its output gradients at the ``T`` output
positions, the group's weight gradient is ``G_iᵀ A_i`` (Bu et al. 2022, "Scalable and
Efficient Training of Large Convolutional Neural Networks with Differential Privacy"), so

    ‖∇W_i‖²_F = Σ_groups ⟨A_i A_iᵀ, G_i G_iᵀ⟩     (ghost identity per group),

and the bias gradient is ``Σ_t g_t``. The weighted sum ``Σ_i f_i ∇W_i`` is the ordinary batch
weight gradient of the convolution with each sample's output gradient scaled by ``f_i``.
The patches are the im2col windows of :func:`opacus_dp.grad_sample.conv.conv_windows`
(padding applied as the layer's forward applies it).
"""

import math
from typing import Dict, List, Union

import torch
import torch.nn as nn
from torch.nn import grad as conv_grad

from opacus_dp.grad_sample.conv import _prepare_input, conv_windows, side_padding
from opacus_dp.grad_sample.norm_samplers.table import register_ghost_layer, trainable
from opacus_dp.grad_sample.registry import register_norm_sampler

ConvNd = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]
CONV_TYPES = [nn.Conv1d, nn.Conv2d, nn.Conv3d]
_WEIGHT_GRAD = {1: conv_grad.conv1d_weight, 2: conv_grad.conv2d_weight, 3: conv_grad.conv3d_weight}


def _check_batched(layer: ConvNd, x: torch.Tensor) -> None:
    if x.dim() != len(layer.kernel_size) + 2:
        raise ValueError(
            f"{type(layer).__name__} ghost norms need batched input (B, C, ...) with the batch "
            f"first; got shape {tuple(x.shape)}. Add a batch dimension to unbatched inputs."
        )


@register_norm_sampler(CONV_TYPES)
def conv_norm_sample(layer: ConvNd, activations: List[torch.Tensor],
                     backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norms of the weight (ghost identity per group) and bias gradients."""
    x = activations[0].to(backprops.dtype)
    _check_batched(layer, x)
    norms = {}
    batch = backprops.shape[0]
    if trainable(layer.weight):
        if batch == 0:
            norms[layer.weight] = backprops.new_zeros(0)
        else:
            a = conv_windows(layer, x).flatten(0, 1)                  # (B*G, d, T)
            g = backprops.reshape(batch * layer.groups, -1, a.shape[-1])  # (B*G, p, T)
            gram_a = torch.bmm(a.transpose(1, 2), a)
            gram_g = torch.bmm(g.transpose(1, 2), g)
            norms[layer.weight] = (gram_a * gram_g).sum(dim=(1, 2)).view(batch, -1).sum(dim=1)
    if trainable(layer.bias):
        norms[layer.bias] = backprops.flatten(start_dim=2).sum(dim=2).pow(2).sum(dim=1)
    return norms


def conv_weighted_grad(layer: ConvNd, activations: List[torch.Tensor], backprops: torch.Tensor,
                       factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``Σ_i f_i ∇W_i`` as one weight-gradient convolution; ``Σ_i f_i Σ_t g_it`` for the bias."""
    sums = {}
    if trainable(layer.weight) and layer.weight in factors:
        x, padding = _prepare_input(layer, activations[0].to(backprops.dtype))
        f = factors[layer.weight].to(backprops.dtype).view(-1, *[1] * (backprops.dim() - 1))
        x, gy = (x * f, backprops) if x.numel() <= backprops.numel() else (x, backprops * f)
        sums[layer.weight] = _WEIGHT_GRAD[x.dim() - 2](
            x, layer.weight.shape, gy, stride=layer.stride, padding=padding,
            dilation=layer.dilation, groups=layer.groups)
    if trainable(layer.bias) and layer.bias in factors:
        per_sample = backprops.flatten(start_dim=2).sum(dim=2)
        sums[layer.bias] = factors[layer.bias].to(per_sample.dtype) @ per_sample
    return sums


def conv_prefers_ghost(layer: ConvNd, activations: List[torch.Tensor]) -> bool:
    """Mixed ghost clipping rule per group: ghost iff ``2 T² < d · p`` (module doc)."""
    x = activations[0]
    positions = 1
    for size, k, s, d, (before, after) in zip(x.shape[2:], layer.kernel_size, layer.stride,
                                               layer.dilation, side_padding(layer)):
        positions *= max(0, (size + before + after - d * (k - 1) - 1) // s + 1)
    d_in = layer.in_channels // layer.groups * math.prod(layer.kernel_size)
    p_out = layer.out_channels // layer.groups
    return 2 * positions * positions < d_in * p_out


register_ghost_layer(CONV_TYPES, weighted_grad=conv_weighted_grad, prefers_ghost=conv_prefers_ghost)
