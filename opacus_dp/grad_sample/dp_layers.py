"""Per-sample gradients of the building blocks of :mod:`opacus_dp.layers`.

* ``BatchFirstLinear`` (alias ``RNNLinear``): an ``nn.Linear`` always called batch-first;
  registered with the Linear sampler (lookup is by exact type, so it is registered
  explicitly). Repeated calls (one per time step) are summed by ``GradSampleModule``.
* ``SequenceBias`` / ``BatchFirstSequenceBias``: ``y_i = concat(x_i, bias)`` along the
  sequence, so with ``g_i`` the gradient w.r.t. ``y_i`` (shape ``(S + 1, E)`` once the batch
  is on dim 0): ``dL_i/dbias = g_i[S]`` (the appended step), reshaped to the parameter's
  ``(1, 1, E)``; its squared norm is ``||g_i[S]||^2``.
"""

from typing import Dict, List

import torch

from opacus_dp.grad_sample.linear import linear_grad_sample
from opacus_dp.grad_sample.registry import register_grad_sampler, register_norm_sampler
from opacus_dp.layers.batch_first import BatchFirstLinear, BatchFirstSequenceBias, SequenceBias

register_grad_sampler(BatchFirstLinear)(linear_grad_sample)


@register_grad_sampler([SequenceBias, BatchFirstSequenceBias])
def sequence_bias_grad_sample(
    layer: SequenceBias, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``bias``: the backprop of the appended (last) step."""
    if not layer.bias.requires_grad:
        return {}
    return {layer.bias: backprops[:, -1].reshape(backprops.shape[0], *layer.bias.shape)}


@register_norm_sampler([SequenceBias, BatchFirstSequenceBias])
def sequence_bias_norm_sample(
    layer: SequenceBias, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norm of ``bias``'s gradient: ``||g_i[S]||^2``."""
    if not layer.bias.requires_grad:
        return {}
    return {layer.bias: backprops[:, -1].pow(2).sum(dim=-1)}
