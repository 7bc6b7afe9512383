"""Keep autograd from computing weight gradients that the norms-only modes replace.

In the ``ghost``/``bk`` modes the update ``Σ_i f_i g_i`` is assembled from the recorded layer
inputs and output gradients, so autograd's own weight gradient ``Σ_i g_i`` (a third of a
Linear layer's backward arithmetic) is wasted work. While a hooked layer runs on inputs of
which at least one requires grad, its own parameters are switched to
``requires_grad=False``; a forward hook (run first, and also when the forward raises)
switches them back. The gradients w.r.t. the *inputs* are unchanged (they do not depend on
whether the parameters require grad), and the layer's output still requires grad through
its inputs, so the per-sample hooks see its output gradient.

A layer none of whose inputs requires grad (the first layer: data, token indices) keeps its
parameters as they are: there they are the only path by which the output requires grad.
Autograd then also fills ``p.grad`` of those parameters; the optimizer overwrites it.
"""

from typing import Callable, List

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from opacus_dp.grad_sample.support import own_parameters


def _carries_grad(args, kwargs) -> bool:
    """True if a tensor among the call's arguments requires grad."""
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple, dict)) and _carries_grad(tree_leaves(value), {}):
            return True
    return any(_carries_grad((v,), {}) for v in kwargs.values())


def skip_weight_grads(layer: nn.Module, is_active: Callable[[], bool]) -> List[object]:
    """Install the switch on ``layer``; returns the hook handles (remove them to undo).

    ``is_active()`` is asked at every call (e.g. False while hooks are disabled or while a
    layer is recomputed for the ``torch.func`` fallback).
    """
    params = [p for _, p in own_parameters(layer)]
    saved: List[List[torch.Tensor]] = []

    def before(module, args, kwargs):
        switched = []
        if is_active() and torch.is_grad_enabled() and _carries_grad(args, kwargs):
            switched = [p for p in params if p.requires_grad]
            for p in switched:
                p.requires_grad_(False)
        saved.append(switched)

    def after(module, args, kwargs, output):
        for p in saved.pop() if saved else ():
            p.requires_grad_(True)

    return [
        layer.register_forward_pre_hook(before, with_kwargs=True),
        layer.register_forward_hook(after, with_kwargs=True, prepend=True, always_call=True),
    ]
