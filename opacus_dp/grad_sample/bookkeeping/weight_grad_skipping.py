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

The switch also reveals a parameter used *outside* its layer (``F.linear(h, emb.weight)`` in
a parent's forward or in the loss): the layer's calls add no gradient to it, so any gradient
autograd accumulates into it comes from elsewhere, and has no per-sample gradient — the update
would silently leave that use out. :class:`OutsideUseCheck` raises at that backward pass,
naming the parameter (parameters of calls that were not switched — a layer of another type on
data, hooks disabled — are excused until the step consumes the batch).
"""

import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.layers.batch_first import BatchFirstLinear

ANCHORED_TYPES = (nn.Linear, BatchFirstLinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding,
                  nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm) \
    + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
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


class OutsideUseCheck:
    """Raises when autograd accumulates a gradient into a watched parameter that was not
    excused, i.e. whose layer ran every call with its weight gradients switched off."""

    def __init__(self, names: Dict[int, str]):
        self._names = names
        self._watched: set = set()
        self._excused: set = set()
        self._noted: Dict[int, Optional[tuple]] = {}  # note_grad
        self._handles: List[object] = []

    def watch(self, param: torch.Tensor) -> None:
        """Hook ``param`` once it is trainable (a frozen tensor has nothing to accumulate)."""
        if id(param) not in self._watched and param.requires_grad:
            self._watched.add(id(param))
            self._handles.append(param.register_post_accumulate_grad_hook(self._accumulated))

    def remove(self) -> None:
        """Remove the hooks (a handle of the wrapper, like the layers' hook handles)."""
        while self._handles:
            self._handles.pop().remove()
        self._watched.clear()

    def excuse(self, param: torch.Tensor) -> None:
        """A call of the layer left ``param`` requiring grad: its own gradient is legitimate
        (until :meth:`reset`)."""
        self._excused.add(id(param))

    def reset(self) -> None:
        """The per-sample state was consumed (a step): excuses end with the passes they covered."""
        self._excused.clear()

    def note_grad(self, param: torch.Tensor) -> None:
        """Note ``param.grad`` as it is now. A compiled backward (AOT autograd) runs the
        accumulation hooks of every parameter that is an input of its graph, also of one it gives
        no gradient (a tapped layer's, :mod:`~opacus_dp.grad_sample.traced_taps`); a gradient
        accumulated since this call makes ``param.grad`` a new tensor or raises its version."""
        grad = param.grad
        self._noted[id(param)] = None if grad is None else (weakref.ref(grad), grad._version)

    def _unchanged(self, param: torch.Tensor) -> bool:
        if id(param) not in self._noted:
            return False
        noted, grad = self._noted[id(param)], param.grad
        return grad is None if noted is None else (grad is noted[0]() and grad._version == noted[1])

    def _accumulated(self, param: torch.Tensor) -> None:
        if id(param) in self._excused or self._unchanged(param):
            return
        name = self._names.get(id(param), str(tuple(param.shape)))
        raise RuntimeError(
            f"parameter {name} received a gradient from a use outside the module that owns it "
            "(e.g. F.linear(h, emb.weight) in a parent's forward or in the loss): that use has "
            "no per-sample gradient and would be left out of the private update. Use the "
            "parameter only through modules, e.g. tie a second module to it "
            "(head = nn.Linear(d, vocab, bias=False); head.weight = emb.weight); for a penalty "
            "on the weights in the loss, use the optimizer's weight_decay instead"
        )


class Switches:
    """The parameters switched off by calls still running, per layer: a call interrupted by a
    ``KeyboardInterrupt`` skips torch's ``always_call`` hooks, so :meth:`restore` (at the next
    forward of the wrapper, and when its per-sample state is taken or cleared) turns them back
    on; nothing else is running then."""

    def __init__(self):
        self.stacks: List[List[tuple]] = []

    def restore(self) -> None:
        for stack in self.stacks:
            while stack:
                for p in stack.pop()[0]:
                    p.requires_grad_(True)


def skip_weight_grads(layer: nn.Module, is_active: Callable[[], bool],
                      check: Optional[OutsideUseCheck] = None,
                      recomputing: Callable[[], bool] = lambda: False,
                      switches: Optional[Switches] = None) -> List[object]:
    """Install the switch on ``layer``; returns the hook handles (remove them to undo).

    ``is_active()`` is asked at every call (e.g. False while hooks are disabled or while a
    layer is recomputed for the ``torch.func`` fallback: ``recomputing()``, which computes
    with copies of the parameters and so excuses nothing). With ``check``, the layer's
    parameters are watched, from their first call on, for gradients from outside uses
    (``check.remove()`` undoes that); ``switches`` keeps the layer's stack of running calls.
    """
    anchored = formula_class(layer) in ANCHORED_TYPES
    saved: List[tuple] = []
    if switches is not None:
        switches.stacks.append(saved)

    def before(module, args, kwargs):
        # the tensors the layer holds now: FSDP2 swaps in unsharded ones while it runs
        params = [p for p in layer._parameters.values() if p is not None]
        if check is not None:
            for p in params:  # also a tensor unfrozen since the wrapper was built
                check.watch(p)
        switched, anchor = [], False
        # a replica made by nn.DataParallel around the wrapper shares the hooks: its parameters
        # are differentiable copies whose gradients reach the masters' p.grad (legitimately)
        active = torch.is_grad_enabled() and is_active() and module is layer
        carries = active and _carries_grad(args, kwargs)
        if carries or (active and anchored):
            switched = [p for p in params if p.requires_grad]
            anchor = bool(switched) and not carries
            for p in switched:
                p.requires_grad_(False)
        elif check is not None and torch.is_grad_enabled() and not recomputing():
            for p in params:  # autograd computes their gradient in this call
                check.excuse(p)
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
