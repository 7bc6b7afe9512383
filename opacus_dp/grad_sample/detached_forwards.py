"""A hooked layer's output computed again from detached parameters: what the traced taps
(:mod:`~opacus_dp.grad_sample.traced_taps`) use in a compiled graph where the eager hooks would
switch the layer's parameters off (``skip_weight_grads``,
:mod:`~opacus_dp.grad_sample.bookkeeping.weight_grad_skipping`).

``y = f(x; W)`` becomes ``f(x; W.detach())``: the same values, the same gradient with respect to
``x``, and no weight gradient (the norms-only modes form the update from the recorded calls). The
first ``y`` is then unused, and the graph drops it. Calls ``layer(x)`` only.
"""

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrize import is_parametrized

from opacus_dp.torch_internals import reparametrized


def _detached(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.detach()


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight.detach(), _detached(layer.bias))


def _conv(layer: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    return layer._conv_forward(x, layer.weight.detach(), _detached(layer.bias))


def _embedding(layer: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.embedding(x, layer.weight.detach(), layer.padding_idx, None, layer.norm_type,
                       layer.scale_grad_by_freq, layer.sparse)


def _layer_norm(layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, layer.normalized_shape, _detached(layer.weight), _detached(layer.bias), layer.eps)


def _group_norm(layer: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x, layer.num_groups, _detached(layer.weight), _detached(layer.bias), layer.eps)


_FORWARDS: Dict[Callable, Callable] = {
    nn.Linear.forward: _linear,
    nn.Conv1d.forward: _conv,
    nn.Conv2d.forward: _conv,
    nn.Conv3d.forward: _conv,
    nn.Embedding.forward: _embedding,
    nn.LayerNorm.forward: _layer_norm,
    nn.GroupNorm.forward: _group_norm,
}


def _any(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own ``forward`` (not its hooks) with its parameters swapped for detached ones
    for the call (``torch.nn.utils.stateless``, what ``torch.func.functional_call`` uses)."""
    detached = {name: p.detach() for name, p in layer.named_parameters(recurse=False)}
    with reparametrized(layer, detached):
        return layer.forward(x)


def detached_forward(layer: nn.Module) -> Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    """``f(layer, x)``, the layer's output from detached parameters: torch's layers above, any
    other layer without buffers by :func:`_any` (its ``forward`` runs twice in the traced code, the
    first result unused: a ``forward`` with side effects other than on buffers must not be
    hooked); None for a parametrized layer, whose ``weight`` is computed, and an ``nn.Embedding``
    with ``max_norm``, whose call rescales its weight."""
    forward = _FORWARDS.get(type(layer).forward)
    if is_parametrized(layer) or (forward is _embedding and layer.max_norm is not None):
        return None
    if forward is None and next(layer.buffers(recurse=False), None) is None:
        return _any
    return forward
