"""Per-sample gradients of the normalisation layers that are compatible with DP-SGD.

Every layer here computes ``y = x_hat * w + b`` where ``x_hat`` normalises each sample with
statistics of that sample only (unlike BatchNorm), so with output gradient ``gy``

    dL_i/dw = sum over the dims not covered by ``w`` (except the batch) of  x_hat_i * gy_i
    dL_i/db = the same sum of  gy_i

``x_hat`` is recomputed from the recorded input with the layer's own ``eps`` (LayerNorm and
GroupNorm: from the statistics ``(mean, rstd)`` their forward saved, where available, see
:func:`saved_statistics`):

* ``LayerNorm``:    (x - mean) / sqrt(var + eps) over the trailing ``normalized_shape`` dims;
* ``RMSNorm``:      x / sqrt(mean(x^2) + eps) over the trailing ``normalized_shape`` dims
                    (``eps=None`` means ``torch.finfo(input dtype).eps``, as in torch);
* ``GroupNorm``:    (x - mean) / sqrt(var + eps) over each group of C/G channels and all
                    spatial positions; ``w``, ``b`` are per channel;
* ``InstanceNorm``: the same per channel over the spatial positions; in eval mode with
                    ``track_running_stats=True`` the running statistics are used, as in torch.
Variances are the biased (1/n) ones.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample.registry import register_grad_sampler, register_saved_statistics
from opacus_dp.grad_sample.support import sum_over_positions
from opacus_dp.maths.layouts import channels_innermost, positions_by_channels
from opacus_dp.module_parameters import trainable
from opacus_dp.torch_internals import saved_tensor_hooks_active, saved_value

InstanceNormNd = Union[nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]


def _sum_over(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``t`` summed over ``dims``; a copy of ``t`` when there are none (results never alias
    ``backprops``, so a consumer may scale each per-sample gradient in place). The middle
    dimensions of a contiguous ``(B, *middle, *trailing)`` go through
    :func:`~opacus_dp.grad_sample.support.sum_over_positions`."""
    dims = tuple(dims)
    if not dims:
        return t.clone()
    trailing = t.shape[1 + len(dims):]
    if dims == tuple(range(1, 1 + len(dims))) and trailing and t.is_contiguous():
        flat = t.view(t.shape[0], math.prod(t.shape[1:1 + len(dims)]), math.prod(trailing))
        return sum_over_positions(flat).view(t.shape[0], *trailing)
    return t.sum(dim=dims)


def _affine_grads(layer, x_hat_fn, backprops: torch.Tensor, reduce_dims) -> Dict:
    """Per-sample ``{weight: sum(x_hat * gy), bias: sum(gy)}`` over ``reduce_dims``.

    ``x_hat_fn`` returns a new tensor (it is multiplied in place); it is only called when the
    weight is trainable and there is data to normalise (torch's instance norm rejects empty
    batches: the sum of no terms, zeros, is returned without it).
    """
    grads = {}
    weight, bias = layer.weight, getattr(layer, "bias", None)
    if trainable(weight):
        if backprops.numel() == 0:
            grads[weight] = _sum_over(backprops, reduce_dims)
        else:
            grads[weight] = _sum_over(x_hat_fn().mul_(backprops), reduce_dims)
    if trainable(bias):
        grads[bias] = _sum_over(backprops, reduce_dims)
    return grads


def _check_trailing_shape(layer, x: torch.Tensor) -> None:
    trailing = tuple(layer.normalized_shape)
    if x.dim() < len(trailing) + 1 or tuple(x.shape[x.dim() - len(trailing) :]) != trailing:
        raise ValueError(
            f"{type(layer).__name__}(normalized_shape={trailing}) per-sample gradients need input "
            f"of shape (B, ..., *{trailing}) with the batch first; got {tuple(x.shape)}."
        )


def _check_channels(layer, x: torch.Tensor, channels: int) -> None:
    if x.dim() < 2 or x.shape[1] != channels:
        raise ValueError(
            f"{type(layer).__name__} with {channels} channels needs per-sample gradients on input "
            f"of shape (B, {channels}, ...) with the batch first; got {tuple(x.shape)}."
        )


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(
    layer: nn.LayerNorm, activations: List[torch.Tensor], backprops: torch.Tensor,
    statistics: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``LayerNorm`` weight and bias (``x_hat`` in the module doc);
    ``x_hat = x · rstd − mean · rstd`` from the forward's saved ``statistics`` where they fit
    (the form torch's kernel normalises with), else recomputed."""
    x = activations[0].to(backprops.dtype)
    _check_trailing_shape(layer, x)
    reduce_dims = range(1, x.dim() - len(layer.normalized_shape))

    fit = statistics is not None and _layer_statistics_fit(layer, x, statistics)
    if fit and _per_sample_kernel_pays(layer, x, backprops):
        return _layer_norm_grads_per_sample(layer, x, backprops, statistics)

    def x_hat():
        if fit:
            mean, rstd = statistics
            return torch.addcmul(-mean * rstd, x, rstd)
        return F.layer_norm(x, layer.normalized_shape, eps=layer.eps)

    return _affine_grads(layer, x_hat, backprops, reduce_dims)


# Per-sample elements from which the per-sample kernel calls are used on CPU: one fused pass per
# sample against the batched form's four passes and new tensor; below it the overhead of B
# separate calls outweighs the passes saved.
PER_SAMPLE_KERNEL_MIN_ELEMENTS = 16384


def _per_sample_kernel_pays(layer: nn.LayerNorm, x: torch.Tensor, backprops: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and all(p is None or p.dtype == x.dtype for p in (layer.weight, layer.bias))
            and x.shape[0] > 0 and x[0].numel() >= PER_SAMPLE_KERNEL_MIN_ELEMENTS
            and backprops.shape == x.shape)


def _layer_norm_grads_per_sample(layer: nn.LayerNorm, x: torch.Tensor, backprops: torch.Tensor,
                                 statistics) -> Dict[nn.Parameter, torch.Tensor]:
    """``Σ x_hat·gy`` and ``Σ gy`` of each sample from torch's own LayerNorm backward kernel
    (weight and bias gradients only), called on one sample at a time with the forward's
    saved statistics: one fused pass over ``x`` and ``gy``, where the batched form
    (``x_hat``, its product with ``gy``, two sums) makes four and a new tensor."""
    mean, rstd = statistics
    wanted = [False, trainable(layer.weight), trainable(layer.bias)]
    shape = list(layer.normalized_shape)
    rows = [torch.ops.aten.native_layer_norm_backward(backprops[i], x[i], shape, mean[i], rstd[i],
                                                      layer.weight, layer.bias, wanted)
            for i in range(x.shape[0])]
    grads = {}
    if wanted[1]:
        grads[layer.weight] = torch.stack([r[1] for r in rows])
    if wanted[2]:
        grads[layer.bias] = torch.stack([r[2] for r in rows])
    return grads


def _layer_statistics_fit(layer: nn.LayerNorm, x: torch.Tensor, statistics) -> bool:
    mean, rstd = statistics
    kept = x.dim() - len(layer.normalized_shape)
    shape = tuple(x.shape[:kept]) + (1,) * len(layer.normalized_shape)
    return tuple(mean.shape) == shape == tuple(rstd.shape) and x.dtype == mean.dtype == rstd.dtype


@register_grad_sampler(nn.GroupNorm)
def group_norm_grad_sample(
    layer: nn.GroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor,
    statistics: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``GroupNorm`` per-channel weight and bias; from the forward's
    saved ``statistics`` (:func:`saved_statistics`) in one pass where they fit."""
    x = activations[0].to(backprops.dtype)
    _check_channels(layer, x, layer.num_channels)
    if statistics is not None:
        if _lifted_by_autocast(layer, x, statistics):
            x, backprops = x.to(statistics[0].dtype), backprops.to(statistics[0].dtype)
        if _group_statistics_fit(layer, x, backprops, statistics):
            if channels_innermost(x) and channels_innermost(backprops) and x.dtype in (torch.float32, torch.float64):
                return _group_norm_grads_channels_last(layer, x, backprops, statistics)
            return _group_norm_grads_from_statistics(layer, x, backprops, statistics)

    def x_hat():
        return F.group_norm(x, layer.num_groups, eps=layer.eps)

    return _affine_grads(layer, x_hat, backprops, range(2, x.dim()))


_STATISTICS_NODES = {nn.GroupNorm: "NativeGroupNormBackward0", nn.LayerNorm: "NativeLayerNormBackward0"}


@register_saved_statistics([nn.GroupNorm, nn.LayerNorm])
def saved_statistics(layer: nn.Module, output) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(mean, rstd)`` as the forward saved them for its backward (``rstd = 1/sqrt(var +
    eps)``): per sample and group ``(B, G)`` for GroupNorm, per normalised row ``(..., 1)``
    for LayerNorm; None when the output is not that op's own result or saved-tensor hooks
    (checkpointing, offloading) may be packing them."""
    node = getattr(output, "grad_fn", None)
    expected = next(name for kind, name in _STATISTICS_NODES.items() if isinstance(layer, kind))
    if node is None or type(node).__name__ != expected or saved_tensor_hooks_active():
        return None
    return saved_value(node, "result1").detach(), saved_value(node, "result2").detach()


def _lifted_by_autocast(layer: nn.GroupNorm, x: torch.Tensor, statistics) -> bool:
    """A half-precision input normalised with float32 statistics into a float32-parameter layer
    (bfloat16 autocast on CPU): its per-sample sums are taken in float32, from the statistics, as
    torch's own backward takes its weight gradient (not from a normalisation recomputed in half
    precision)."""
    mean = statistics[0]
    return (x.dtype in (torch.float16, torch.bfloat16) and mean.dtype == torch.float32
            and layer.weight is not None and layer.weight.dtype == torch.float32)


def _group_statistics_fit(layer: nn.GroupNorm, x: torch.Tensor, backprops: torch.Tensor,
                          statistics) -> bool:
    mean, rstd = statistics
    return (x.shape[0] > 0 and tuple(mean.shape) == (x.shape[0], layer.num_groups)
            and rstd.shape == mean.shape and x.dtype == mean.dtype == rstd.dtype
            and backprops.shape == x.shape)


def _group_norm_grads_from_statistics(layer: nn.GroupNorm, x: torch.Tensor, backprops: torch.Tensor,
                                      statistics) -> Dict[nn.Parameter, torch.Tensor]:
    """``Σ_s x_hat·gy`` and ``Σ_s gy`` per sample and channel from torch's own GroupNorm weight
    gradient kernel run on the batch folded into the channels (``1 × B·C`` channels in ``B·G``
    groups: the same groups, each sample's channels apart): one pass over ``x`` and ``gy``."""
    mean, rstd = statistics
    batch, channels, groups = x.shape[0], x.shape[1], layer.num_groups
    spatial = x[0, 0].numel()
    wanted = [False, trainable(layer.weight), trainable(layer.bias)]
    _, weight_grad, bias_grad = torch.ops.aten.native_group_norm_backward(
        backprops.reshape(1, batch * channels, spatial), x.reshape(1, batch * channels, spatial),
        mean.reshape(1, batch * groups), rstd.reshape(1, batch * groups), None,
        1, batch * channels, spatial, batch * groups, wanted)
    grads = {}
    if wanted[1]:
        grads[layer.weight] = weight_grad.view(batch, channels)
    if wanted[2]:
        grads[layer.bias] = bias_grad.view(batch, channels)
    return grads


def _group_norm_grads_channels_last(layer: nn.GroupNorm, x: torch.Tensor, backprops: torch.Tensor,
                                    statistics) -> Dict[nn.Parameter, torch.Tensor]:
    """The sums of :func:`_group_norm_grads_from_statistics` read in the channels-last layout
    (where folding the batch into the channels would copy ``x`` and ``gy``): per sample and
    channel ``c`` of group ``g``, ``Σ_s x_hat·gy = rstd_g (Σ_s x·gy − mean_g Σ_s gy)``, the sums
    over the positions of ``(B, positions, C)`` views."""
    mean, rstd = statistics
    channels = x.shape[1]
    x_rows, gy_rows = positions_by_channels(x), positions_by_channels(backprops)
    sum_gy = gy_rows.sum(dim=1)  # with few channels per row, faster than sum_over_positions' product
    grads = {}
    if trainable(layer.weight):
        per_group = channels // layer.num_groups
        mean_c, rstd_c = (t.repeat_interleave(per_group, dim=1) for t in (mean, rstd))
        grads[layer.weight] = (x_rows * gy_rows).sum(dim=1).sub_(mean_c * sum_gy).mul_(rstd_c)
    if trainable(layer.bias):
        grads[layer.bias] = sum_gy
    return grads


def _instance_norm_x_hat(layer: InstanceNormNd, x: torch.Tensor) -> torch.Tensor:
    """``x`` normalised per (sample, channel) exactly as the layer's forward pass does."""
    if layer.training or not layer.track_running_stats:
        return F.instance_norm(x, eps=layer.eps)
    return F.instance_norm(
        x,
        running_mean=layer.running_mean,
        running_var=layer.running_var,
        use_input_stats=False,
        eps=layer.eps,
    )


@register_grad_sampler([nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d])
def instance_norm_grad_sample(
    layer: InstanceNormNd, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``InstanceNorm1d/2d/3d`` per-channel weight and bias."""
    x = activations[0].to(backprops.dtype)
    _check_channels(layer, x, layer.num_features)
    x_hat = lambda: _instance_norm_x_hat(layer, x)  # noqa: E731
    return _affine_grads(layer, x_hat, backprops, range(2, x.dim()))


if hasattr(nn, "RMSNorm"):

    @register_grad_sampler(nn.RMSNorm)
    def rms_norm_grad_sample(
        layer: nn.RMSNorm, activations: List[torch.Tensor], backprops: torch.Tensor
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """Per-sample gradient of the ``RMSNorm`` weight (``x_hat`` in the module doc)."""
        eps = layer.eps if layer.eps is not None else torch.finfo(activations[0].dtype).eps
        x = activations[0].to(backprops.dtype)
        _check_trailing_shape(layer, x)
        reduce_dims = range(1, x.dim() - len(layer.normalized_shape))

        def x_hat():
            return F.rms_norm(x, layer.normalized_shape, eps=eps)

        return _affine_grads(layer, x_hat, backprops, reduce_dims)
