"""Keep autograd from computing weight gradients that the norms-only modes replace.

In the ``ghost``/``bk`` modes the update ``Σ_i f_i g_i`` is assembled from the recorded layer
inputs and output gradients, so autograd's own weight gradient ``Σ_i g_i`` (a third of a
Linear layer's backward arithmetic) is wasted work. While a hooked layer runs, its own
parameters are switched to ``requires_grad=False``; a forward hook (run before the other
forward hooks, and also when the forward raises) switches them back. Gradients w.r.t. the
*inputs* do not depend on whether the parameters require grad, so they are unchanged.

The per-sample hooks need the layer's output to require grad:

* if one of the layer's inputs requires grad, the output does through it;
* otherwise (the first layer: data, token indices) the output of a layer of
  :data:`ANCHORED_TYPES` is marked, in place and without a copy, as the output of an
  identity autograd node (``_Anchor``), so that its gradient is still computed and seen by
  the hooks; these layers' backward never uses their output, so the in-place mark is safe;
* a layer of another type keeps its parameters as they are for such a call (they are the
  only path by which its output requires grad); autograd then also fills their ``p.grad``,
  which the optimizer overwrites.
"""

from typing import Callable, List

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from opacus_dp.grad_sample.support import own_parameters
from opacus_dp.layers.batch_first import BatchFirstLinear

ANCHORED_TYPES = (nn.Linear, BatchFirstLinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding,
                  nn.LayerNorm, nn.GroupNorm)
_ANCHOR = torch.zeros((), requires_grad=True)


class _Anchor(torch.autograd.Function):
    """Identity on ``output`` (marked as modified in place) that makes it require grad."""

    @staticmethod
    def forward(ctx, output, anchor):
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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
    anchored = type(layer) in ANCHORED_TYPES
    saved: List[tuple] = []

    def before(module, args, kwargs):
        switched, anchor = [], False
        if is_active() and torch.is_grad_enabled():
            carries = _carries_grad(args, kwargs)
            if carries or anchored:
                switched = [p for p in params if p.requires_grad]
                anchor = bool(switched) and not carries
                for p in switched:
                    p.requires_grad_(False)
        saved.append((switched, anchor))

    def after(module, args, kwargs, output):
        switched, anchor = saved.pop() if saved else ((), False)
        for p in switched:
            p.requires_grad_(True)
        if anchor and isinstance(output, torch.Tensor) and not output.requires_grad:
            return _Anchor.apply(output, _ANCHOR)
        return None

    return [
        layer.register_forward_pre_hook(before, with_kwargs=True),
        layer.register_forward_hook(after, with_kwargs=True, prepend=True, always_call=True),
    ]
