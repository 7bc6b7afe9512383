"""A layer's own forward, recomputed for its per-sample gradients (the ``torch.func`` paths)."""

from typing import Dict

import torch
import torch.nn as nn

from opacus_dp.torch_internals import reparametrized


def own_forward(layer: nn.Module, tensors: Dict[str, torch.Tensor], args: tuple, kwargs: dict):
    """``layer.forward(*args, **kwargs)`` with ``tensors`` in place of the layer's parameters of
    those names, as ``torch.func.functional_call`` calls the layer but without its hooks: ``args``
    are what the forward received (after any pre-hook), and a per-sample gradient is that of the
    forward's own output, whatever a user's forward hook makes of it afterwards."""
    with reparametrized(layer, tensors):
        return layer.forward(*args, **kwargs)
