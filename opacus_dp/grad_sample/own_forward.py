"""A layer's own forward, recomputed for its per-sample gradients (the ``torch.func`` paths)."""

from typing import Dict

import torch
import torch.nn as nn

from opacus_dp.module_parameters import is_fsdp_module
from opacus_dp.torch_internals import reparametrized


def own_forward(layer: nn.Module, tensors: Dict[str, torch.Tensor], args: tuple, kwargs: dict):
    """``layer.forward(*args, **kwargs)`` with ``tensors`` in place of the layer's parameters of
    those names, as ``torch.func.functional_call`` calls the layer but without its hooks: ``args``
    are what the forward received (after any pre-hook), and a per-sample gradient is that of the
    forward's own output, the output the wrapper's capture hook, the first of the layer's forward
    hooks, hooked.

    A layer passed to FSDP2's ``fully_shard`` itself (of a class without per-layer formulas: the
    others never come here) is called with its hooks, as ``functional_call`` calls it (its
    pre-forward hook gathers the parameters its forward reads); there the capture hook runs after
    the forward hooks registered before it, so the output it hooked is the one this call returns."""
    with reparametrized(layer, tensors):
        if is_fsdp_module(layer):
            return layer(*args, **kwargs)
        return layer.forward(*args, **kwargs)
