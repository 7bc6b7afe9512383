"""Per-sample gradients of ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``.

For a convolution with ``G`` groups, input ``x_i`` (after the layer's padding) and output
gradient ``gy_i`` of sample ``i``, the per-sample gradients are

    dL_i/dW[o, c, k] = sum_l gy_i[o, l] * x_i[g(o) * C/G + c, l * stride + k * dilation]
    dL_i/db[o]       = sum_l gy_i[o, l]

i.e. the weight gradient of the same convolution run on sample ``i`` alone. Two equivalent
ways to get all ``B`` of them at once, chosen by measurement (``scripts/benchmark_layers.py``):

* folded convolution (Rochette et al., "Efficient per-example gradient computations in
  convolutional neural networks", 2019): fold the batch into the channel axis -- input
  ``(1, B*C, ...)``, output gradient ``(1, B*O, ...)``, ``B*G`` groups -- and take that
  convolution's weight gradient, of shape ``(B*O, C/G, *kernel)``: the stack of the
  per-sample gradients. Fastest on CPU for large spatial outputs and for grouped/depthwise
  layers (no intermediate copy of the input). On CPU it runs over blocks of samples whose
  gradients, inputs and output gradients each fill at most about 2 MiB, each block written into
  the result: the convolution's own weight-gradient buffer and the copy it makes of it stay that
  small (not two of the result's size), and a block's operands stay in cache (a channels-last
  block is copied to the default layout there: docs/benchmarks.md, "Channels-last image
  models"). Each sample's gradient is its own group's convolution either way: the same
  numbers, bit for bit where the kernel does not depend on the number of groups (float64;
  oneDNN's float32 kernels may block a smaller problem differently, a rounding difference);
* im2col (Chellapilla et al., "High performance convolutional neural networks for document
  processing", 2006) + batched matrix product: ``x`` unfolded to ``(B, G, C/G*K, L)``
  windows, then ``gy @ windows^T`` per sample and group. Faster for ungrouped layers with
  few output positions ``L`` and many channels, e.g. the late stages of a ResNet, and for
  layers with very few input channels (an image network's first layer).

Zero padding that is the same on both sides is handled by the weight-gradient convolution;
any other padding (``padding_mode`` reflect/replicate/circular, or the asymmetric split of
``padding="same"`` for even effective kernels) is applied explicitly with ``F.pad`` first,
exactly as ``torch`` does in the layer's forward pass.
"""

from typing import Dict, List, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import grad as conv_grad

from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.maths.huge_pages import empty_on_huge_pages
from opacus_dp.maths.layouts import positions_by_channels

ConvNd = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]

_WEIGHT_GRAD = {
    1: conv_grad.conv1d_weight,
    2: conv_grad.conv2d_weight,
    3: conv_grad.conv3d_weight,
}


def side_padding(layer: ConvNd) -> List[Tuple[int, int]]:
    """(before, after) padding of each spatial dimension, as the layer's forward applies it.

    ``"same"``: total ``dilation * (kernel - 1)``, the odd element going after (torch's rule).
    """
    if layer.padding == "valid":
        return [(0, 0)] * len(layer.kernel_size)
    if layer.padding == "same":
        pads = []
        for k, d in zip(layer.kernel_size, layer.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in layer.padding]


def _pad_explicitly(x: torch.Tensor, layer: ConvNd, pads: Sequence[Tuple[int, int]]):
    """``x`` padded by ``F.pad`` in the layer's padding mode (F.pad lists the last dim first)."""
    flat = [p for before_after in reversed(pads) for p in before_after]
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(x, flat, mode=mode)


def padded_input(layer: ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded exactly as the layer's forward pass pads it (any padding mode)."""
    return _pad_explicitly(x, layer, side_padding(layer))


def _prepare_input(layer: ConvNd, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """Input and symmetric zero padding to hand to the weight-gradient convolution."""
    pads = side_padding(layer)
    symmetric_zeros = layer.padding_mode == "zeros" and all(a == b for a, b in pads)
    if symmetric_zeros:
        return x, tuple(a for a, _ in pads)
    return _pad_explicitly(x, layer, pads), (0,) * len(pads)


# Bytes of per-sample gradients formed by one folded convolution on CPU (module doc).
FOLDED_BLOCK_BYTES = 2 << 20


def folded_block_rows(layer: ConvNd, x: torch.Tensor, gy: torch.Tensor) -> int:
    """Samples per folded convolution: all on GPUs, else as many as keep the largest of a
    sample's gradient, input and output gradient within ``FOLDED_BLOCK_BYTES``."""
    if x.device.type != "cpu":
        return max(x.shape[0], 1)
    largest = max(layer.weight.numel(), x.shape[1:].numel(), gy.shape[1:].numel())
    return max(1, FOLDED_BLOCK_BYTES // (largest * gy.element_size()))


def folded_conv_weight_grad(layer: ConvNd, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients from folded convolutions, a block of samples at a time."""
    rows = folded_block_rows(layer, x, gy)
    if x.shape[0] <= rows:
        return _folded_block(layer, x, gy)
    grads = empty_on_huge_pages((x.shape[0], *layer.weight.shape), gy.dtype, gy.device)
    for start in range(0, x.shape[0], rows):
        grads[start:start + rows] = _folded_block(layer, x[start:start + rows], gy[start:start + rows])
    return grads


def _folded_block(layer: ConvNd, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients from one convolution with the batch folded into groups."""
    batch = x.shape[0]
    x, padding = _prepare_input(layer, x)
    folded_weight_shape = (batch * layer.out_channels, *layer.weight.shape[1:])
    weight_grad = _WEIGHT_GRAD[x.dim() - 2](
        x.reshape(1, batch * x.shape[1], *x.shape[2:]),
        folded_weight_shape,
        gy.reshape(1, batch * gy.shape[1], *gy.shape[2:]),
        stride=layer.stride,
        padding=padding,
        dilation=layer.dilation,
        groups=batch * layer.groups,
    )
    return weight_grad.view(batch, *layer.weight.shape)


def conv_windows(layer: ConvNd, x: torch.Tensor) -> torch.Tensor:
    """im2col: ``(B, G, C/G * K, L)``, entry ``[i, g, (c, k), l]`` = padded
    ``x_i[g*C/G + c, l*stride + k*dilation]`` (``K`` kernel taps, ``L`` output positions).
    A channels-last ``x`` is made contiguous first: ``K`` times smaller than the windows, and
    they are copied from it several times faster."""
    x = padded_input(layer, x.contiguous())
    spatial = len(layer.kernel_size)
    for dim, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        x = x.unfold(2 + dim, d * (k - 1) + 1, s)  # (..., windows, span)
        if d > 1:
            x = x[..., ::d]
    # x: (B, C, *positions, *taps) -> (B, C, *taps, *positions)
    taps_first = [0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial)]
    positions = x.shape[2 : 2 + spatial].numel()
    return x.permute(taps_first).reshape(x.shape[0], layer.groups, -1, positions)


def im2col_weight_grad(layer: ConvNd, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients as ``gy_i,g @ windows_i,g^T`` (one matrix product per
    sample and group), computed as ``(windows_i,g @ gy_i,g^T)^T`` when the windows have fewer
    rows than the outputs (a layer with few input channels): the product with the smaller side
    as its rows was the faster layout on CPU, and the transposed copy is one weight per sample."""
    windows = conv_windows(layer, x)
    gy_t = positions_by_channels(gy, layer.groups).unflatten(0, (gy.shape[0], layer.groups))  # (B, G, L, O/G)
    if windows.shape[-2] < gy_t.shape[-1]:
        grads = torch.matmul(windows, gy_t).transpose(-1, -2).contiguous()
    else:
        grads = torch.matmul(gy_t.transpose(-1, -2), windows.transpose(-1, -2))
    return grads.view(x.shape[0], *layer.weight.shape)


# Output positions (4x4) up to which ungrouped layers use im2col on CPU: with so few positions and
# many channels its batched matrix product is large and dense, while the folded convolution runs
# B·G tiny convolutions; from 6x6 on, the folded convolution in cache-sized blocks of samples is
# the faster, and on larger outputs the unfolded copy (K times the input) costs more than it
# saves. Grouped layers keep the folded convolution (no copy, and thin products per group).
IM2COL_MAX_POSITIONS = 16
# Input channels up to which im2col is used at any resolution: with so few channels the folded
# convolution's groups are too thin to use the convolution kernel well, and the copy stays small.
IM2COL_MAX_IN_CHANNELS = 4


def prefers_im2col(layer: ConvNd, gy: torch.Tensor) -> bool:
    """True for ungrouped layers with few output positions or few input channels (module doc)."""
    return layer.groups == 1 and (gy.shape[2:].numel() <= IM2COL_MAX_POSITIONS
                                  or layer.in_channels <= IM2COL_MAX_IN_CHANNELS)


def per_sample_conv_weight_grad(
    layer: ConvNd, x: torch.Tensor, gy: torch.Tensor, method: str = "auto"
) -> torch.Tensor:
    """Per-sample weight gradients ``(B, *layer.weight.shape)`` (formula in the module doc).

    ``method``: ``"folded"``, ``"im2col"`` or ``"auto"`` (:func:`prefers_im2col`).
    """
    if method not in ("auto", "folded", "im2col"):
        raise ValueError(f"method must be 'auto', 'folded' or 'im2col', got {method!r}")
    if x.shape[0] == 0:
        return gy.new_zeros((0, *layer.weight.shape))
    if method == "im2col" or (method == "auto" and prefers_im2col(layer, gy)):
        return im2col_weight_grad(layer, x, gy)
    return folded_conv_weight_grad(layer, x, gy)


def _check_batched(layer: ConvNd, x: torch.Tensor, gy: torch.Tensor) -> None:
    spatial = len(layer.kernel_size)
    if x.dim() != spatial + 2 or gy.dim() != spatial + 2:
        raise ValueError(
            f"{type(layer).__name__} per-sample gradients need batched input of shape "
            f"(B, C, {', '.join('*' * spatial)}) with the batch first; got activation shape "
            f"{tuple(x.shape)} and output-gradient shape {tuple(gy.shape)}. Add a batch "
            "dimension (x.unsqueeze(0)) to unbatched inputs."
        )


@register_grad_sampler([nn.Conv1d, nn.Conv2d, nn.Conv3d])
def conv_grad_sample(
    layer: ConvNd, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of the trainable parameters of a ``Conv1d/2d/3d`` layer."""
    x = activations[0].to(backprops.dtype)
    _check_batched(layer, x, backprops)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = per_sample_conv_weight_grad(layer, x, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = backprops.sum(dim=tuple(range(2, backprops.dim())))
    return grads
