"""Per-sample gradients of the normalisation layers that are compatible with DP-SGD.

Every layer here computes ``y = x_hat * w + b`` where ``x_hat`` normalises each sample with
statistics of that sample only (unlike BatchNorm), so with output gradient ``gy``

    dL_i/dw = sum over the dims not covered by ``w`` (except the batch) of  x_hat_i * gy_i
    dL_i/db = the same sum of  gy_i

``x_hat`` is recomputed from the recorded input with the layer's own ``eps``:

* ``LayerNorm``:    (x - mean) / sqrt(var + eps) over the trailing ``normalized_shape`` dims;
* ``RMSNorm``:      x / sqrt(mean(x^2) + eps) over the trailing ``normalized_shape`` dims
                    (``eps=None`` means ``torch.finfo(input dtype).eps``, as in torch);
* ``GroupNorm``:    (x - mean) / sqrt(var + eps) over each group of C/G channels and all
                    spatial positions; ``w``, ``b`` are per channel;
* ``InstanceNorm``: the same per channel over the spatial positions; in eval mode with
                    ``track_running_stats=True`` the running statistics are used, as in torch.
Variances are the biased (1/n) ones.
"""

from typing import Dict, List, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample.registry import register_grad_sampler

InstanceNormNd = Union[nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]


def _sum_over(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``t`` summed over ``dims``; a copy of ``t`` when there are none (results never alias
    ``backprops``, so a consumer may scale each per-sample gradient in place)."""
    return t.sum(dim=tuple(dims)) if len(dims) > 0 else t.clone()


def _affine_grads(layer, x_hat_fn, backprops: torch.Tensor, reduce_dims) -> Dict:
    """Per-sample ``{weight: sum(x_hat * gy), bias: sum(gy)}`` over ``reduce_dims``.

    ``x_hat_fn`` returns a new tensor (it is multiplied in place); it is only called when the
    weight is trainable and there is data to normalise (torch's instance norm rejects empty
    batches: the sum of no terms, zeros, is returned without it).
    """
    grads = {}
    weight, bias = layer.weight, getattr(layer, "bias", None)
    if weight is not None and weight.requires_grad:
        if backprops.numel() == 0:
            grads[weight] = _sum_over(backprops, reduce_dims)
        else:
            grads[weight] = _sum_over(x_hat_fn().mul_(backprops), reduce_dims)
    if bias is not None and bias.requires_grad:
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
    layer: nn.LayerNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``LayerNorm`` weight and bias (``x_hat`` in the module doc)."""
    x = activations[0].to(backprops.dtype)
    _check_trailing_shape(layer, x)
    reduce_dims = range(1, x.dim() - len(layer.normalized_shape))

    def x_hat():
        return F.layer_norm(x, layer.normalized_shape, eps=layer.eps)

    return _affine_grads(layer, x_hat, backprops, reduce_dims)


@register_grad_sampler(nn.GroupNorm)
def group_norm_grad_sample(
    layer: nn.GroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``GroupNorm`` per-channel weight and bias."""
    x = activations[0].to(backprops.dtype)
    _check_channels(layer, x, layer.num_channels)

    def x_hat():
        return F.group_norm(x, layer.num_groups, eps=layer.eps)

    return _affine_grads(layer, x_hat, backprops, range(2, x.dim()))


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
