"""What one forward call of a hooked layer leaves for the backward pass.

A :class:`LayerCall` keeps the call's inputs (detached), where the batch dimension is,
and the batch size ``B``. Per-sample gradient functions expect the batch on dimension 0;
:meth:`LayerCall.batch_first_inputs` moves it there for sequence-first layers.
"""

import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from opacus_dp.grad_sample.modification_guard import changed_before_backward, first_changed, versions_of
from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import lean, producer_of
from opacus_dp.torch_internals import view_base

_SIGNATURES: Dict[type, inspect.Signature] = {}
_NUM_INPUTS: Dict[type, int] = {}


# torch layers whose inputs always have the batch first, whatever the model's layout:
# bags are rows; convolutions and the channel norms take (N, C, *); cells take (N, H).
BATCH_FIRST_LAYERS = (nn.EmbeddingBag, nn.modules.conv._ConvNd, nn.GroupNorm,
                      nn.modules.instancenorm._InstanceNorm, nn.RNNCellBase)


# layers whose 2-D output is (N, features) in either layout: a Linear/LayerNorm on a 2-D input
# (a sequence-first model's head on the last state, say), an Embedding of a 1-D input (a
# per-example id): the batch is dim 0 there too.
FEATURE_LAST_LAYERS = (nn.Linear, nn.LayerNorm, nn.Embedding) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def call_batch_dim(layer: nn.Module, batch_first: bool, output: torch.Tensor) -> int:
    """:func:`layer_batch_dim`, except 0 for a 2-D output of a ``FEATURE_LAST_LAYERS`` layer."""
    if not batch_first and output.dim() == 2 and isinstance(layer, FEATURE_LAST_LAYERS):
        return 0
    return layer_batch_dim(layer, batch_first)


def layer_batch_dim(layer: nn.Module, batch_first: bool) -> int:
    """Dimension of the batch in ``layer``'s inputs and outputs.

    ``0`` when the layer type declares ``_dp_batch_dim = 0`` (e.g. DP RNN cells) or is one of
    ``BATCH_FIRST_LAYERS``, else ``0`` if ``batch_first`` else ``1`` (the model's layout, for
    layers that act on the last dimension, such as ``Linear`` on ``(T, B, d)``).
    """
    declared = getattr(type(layer), "_dp_batch_dim", None)
    if declared is not None:
        return int(declared)
    if isinstance(layer, BATCH_FIRST_LAYERS):
        return 0
    return 0 if batch_first else 1


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _to_batch_first(value: Any, batch_dim: int) -> Any:
    if isinstance(value, torch.Tensor) and batch_dim != 0 and value.dim() > batch_dim:
        return value.movedim(batch_dim, 0)
    return value


def _plain_tensors(values) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values)


def refuse_inference_tensors(args, kwargs, layer_name: str) -> None:
    """Raise if an input of a hooked call was created under ``torch.inference_mode()``: its
    per-sample gradients need the input kept, which autograd refuses for such tensors."""
    values = args if not kwargs and _plain_tensors(args) else tree_leaves((list(args), kwargs))
    if any(isinstance(v, torch.Tensor) and v.is_inference() for v in values):
        raise RuntimeError(
            f"{layer_name}: an input was created under torch.inference_mode(); autograd cannot keep "
            "it for the per-sample gradients (nor for its own backward pass). Compute it under "
            "torch.no_grad() instead, or pass a clone (tensor.clone() outside inference mode)."
        )


def _signature(layer: nn.Module) -> inspect.Signature:
    cls = type(layer)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    return _SIGNATURES[cls]


def _num_inputs(layer: nn.Module) -> int:
    """Number of parameters of ``layer.forward`` after ``self`` (-1 if it takes ``*args``), per
    class (as :func:`_signature`)."""
    cls = type(layer)
    count = _NUM_INPUTS.get(cls)
    if count is None:
        params = list(_signature(layer).parameters.values())[1:]
        variadic = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
        count = _NUM_INPUTS[cls] = -1 if variadic else len(params)
    return count


@dataclass
class LayerCall:
    """Inputs of one call of a layer, with ``batch_size`` rows along ``batch_dim``."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    batch_dim: int
    batch_size: int
    released: bool = False
    producers: Tuple[Any, ...] = ()  # per positional arg: ``producer_of(arg)`` (or all None: ())
    statistics: Optional[Tuple[torch.Tensor, ...]] = None  # a statistics reader's (registry)
    versions: Tuple[int, ...] = ()  # of the tensor arguments at the call (modification_guard)
    outer_task: int = -1  # graph task running at the call (a checkpoint's recomputation), or -1
    autocast: Optional[Tuple[str, torch.dtype]] = None  # (device type, dtype) if autocast was on
    outside_graph: Tuple[bool, ...] = ()  # per positional arg: not from autograd (e.g. data)

    def release(self) -> None:
        """Drop the inputs once the call's per-sample gradients are computed.

        The gradient hook holding this record lives as long as the call's output tensor,
        which a training loop often keeps until the next step; releasing early keeps the
        activations from outliving the backward pass.
        """
        self.args, self.kwargs, self.producers, self.released = (), {}, (), True
        self.outside_graph = ()
        self.statistics = None

    @classmethod
    def capture(cls, args, kwargs, batch_dim: int, batch_size: int,
                track_producers: bool = False) -> "LayerCall":
        """Record a call; tensors are detached (they only feed the per-sample formulas).
        ``track_producers``: also note which inputs are fresh outputs of an activation that
        can be recomputed from its saved input (:meth:`lean_activations`)."""
        if not kwargs and _plain_tensors(args):  # fast path: the common ``layer(x)`` call
            producers = tuple(producer_of(a) for a in args) if track_producers else ()
            if not any(producers):
                producers = ()
            outside = tuple(not a.requires_grad for a in args) if track_producers else ()
            return cls(tuple(a.detach() for a in args), {}, batch_dim, batch_size,
                       producers=producers, versions=versions_of(args), outside_graph=outside)
        call = cls(
            tuple(tree_map(_detach, list(args))),
            dict(tree_map(_detach, dict(kwargs))),
            batch_dim,
            batch_size,
        )
        call.versions = versions_of(call._tensors())
        if track_producers:  # per tensor leaf here, in ``_tensors()`` order
            call.outside_graph = tuple(not v.requires_grad for v in tree_leaves((list(args), kwargs))
                                       if isinstance(v, torch.Tensor))
        return call

    def _tensors(self) -> List[torch.Tensor]:
        if not self.kwargs and _plain_tensors(self.args):
            return list(self.args)
        return [v for v in tree_leaves((list(self.args), self.kwargs)) if isinstance(v, torch.Tensor)]

    def check_unmodified(self, layer_name: str) -> None:
        """Raise if a tensor argument was written in place since the call (it shares its
        version counter with the detached record; see ``modification_guard``)."""
        if not self.released:
            changed = first_changed(self._tensors(), self.versions)
            if changed is not None:
                raise changed_before_backward(layer_name, changed)

    def batch_first_inputs(self) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``(args, kwargs)`` with every tensor's batch dimension moved to 0."""
        if self.batch_dim == 0:
            return self.args, self.kwargs
        move = lambda v: _to_batch_first(v, self.batch_dim)  # noqa: E731
        return tuple(tree_map(move, list(self.args))), dict(tree_map(move, self.kwargs))

    def activations(self, layer: nn.Module) -> List[Any]:
        """Inputs in the order of ``layer.forward``'s signature, defaults filled in.

        This is the ``activations`` list handed to registered grad samplers: for
        ``nn.EmbeddingBag`` it is ``[input, offsets, per_sample_weights]`` however the
        call spelled them.
        """
        args, kwargs = self.batch_first_inputs()
        if not kwargs and len(args) == _num_inputs(layer):  # nothing to fill in or reorder
            return list(args)
        try:
            bound = _signature(layer).bind(layer, *args, **kwargs)
        except TypeError:
            return [*args, *kwargs.values()]
        bound.apply_defaults()
        return list(bound.args[1:]) + list(bound.kwargs.values())

    def kept_activations(self, layer: nn.Module, activations: List[Any]) -> List[Any]:
        """What the ``bk`` mode keeps of ``activations`` until the step: :meth:`lean_activations`,
        with an own copy of each input from outside the autograd graph (a data batch, frozen
        features): a loop may refill such a buffer before the step by means autograd's version
        counter does not see (``.data``, a NumPy view), and the clipped sum must be built from
        the values the norms came from. Those inputs are usually small (the first layer's)."""
        activations = self.lean_activations(layer, activations)
        if not any(self.outside_graph):
            return activations
        if len(self.outside_graph) != len(activations) or len(activations) != len(self.args):
            # not one flag per positional tensor (keywords, None arguments): match by identity
            outside = {id(t) for t, o in zip(self._tensors(), self.outside_graph) if o}
            return [v.clone() if _recorded_in(v, outside) else v for v in activations]
        return [v.clone() if outside and isinstance(v, torch.Tensor) else v
                for v, outside in zip(activations, self.outside_graph)]

    def lean_activations(self, layer: nn.Module, activations: List[Any]) -> List[Any]:
        """``activations`` (as :meth:`activations` returned them) with each input that is a
        recomputable activation's output replaced by a ``RecomputedInput`` holding the
        activation's input instead (see :mod:`~opacus_dp.grad_sample.bookkeeping.recomputed_inputs`);
        call it while that activation's backward has not run yet."""
        if not self.producers or self.kwargs or len(activations) != len(self.args):
            return activations
        result = []
        for value, recorded, producer in zip(activations, self.args, self.producers):
            holders = 1 if value is recorded else 2  # the record, and its batch-first view
            swapped = lean(recorded, producer, self.batch_dim, holders)
            result.append(value if swapped is None else swapped)
        return result


def _recorded_in(value: Any, ids: set) -> bool:
    """Whether ``value`` is one of the recorded tensors ``ids`` or a batch-first view of one."""
    if not isinstance(value, torch.Tensor):
        return False
    return id(value) in ids or (view_base(value) is not None and id(view_base(value)) in ids)


def separate_outputs(output: Any) -> Tuple[Optional[Any], List[torch.Tensor], List[int]]:
    """``(replacement output or None, tensor outputs, indices of the differentiable ones)``.

    A gradient hook on an output tensor receives the *total* gradient of that tensor,
    including what flows back through other outputs derived from it (``(out, out[-1])``).
    Per-sample gradients need each output's own share, so when a call has several
    differentiable outputs they are replaced by clones (the caller gets the clones, the
    hooks watch them). A tensor returned twice is watched once.
    """
    if type(output) is torch.Tensor:  # the common call, without flattening
        return None, [output], [0] if output.requires_grad else []
    leaves, spec = tree_flatten(output)
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    seen: set = set()
    hooked = []
    for index, slot in enumerate(slots):
        tensor = leaves[slot]
        if tensor.requires_grad and id(tensor) not in seen:
            seen.add(id(tensor))
            hooked.append(index)
    if len(hooked) < 2:
        return None, [leaves[s] for s in slots], hooked
    clones = {id(leaves[slots[i]]): leaves[slots[i]].clone() for i in hooked}
    for slot in slots:
        leaves[slot] = clones.get(id(leaves[slot]), leaves[slot])
    return tree_unflatten(leaves, spec), [leaves[s] for s in slots], hooked


def hook_output_grad(output: torch.Tensor, hook) -> None:
    """Call ``hook(dLoss/d output)`` once per backward pass, also after in-place operations.

    An in-place operation on a *view* (e.g. ``y += h`` or ``relu_`` on the output of
    ``F.linear`` for 3-D inputs, which reshapes a 2-D product) gives the view a new autograd
    node, and a hook registered on the view never fires. Such an output that reshapes its whole
    base is hooked on the node that produced the base: its gradient is the output's, reshaped,
    and still the gradient of the values the layer returned.
    """
    base = view_base(output)
    if base is None or base.grad_fn is None or not _reshapes_whole(output, base):
        output.register_hook(hook)
        return
    shape, index = output.shape, base.output_nr

    def prehook(grad_outputs):
        grad = grad_outputs[index]
        if grad is not None:
            hook(grad.reshape(shape))

    base.grad_fn.register_prehook(prehook)


def _reshapes_whole(view: torch.Tensor, base: torch.Tensor) -> bool:
    return (view.numel() == base.numel() and view.storage_offset() == base.storage_offset()
            and view.is_contiguous() and base.is_contiguous())


def per_sample_output_grads(layer: nn.Module,
                            grads: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """``grads`` with each float16 output gradient lifted to float32 where ``layer``'s parameters
    are wider (float16 autocast), exactly (float16 values are float32 values).

    Under a ``GradScaler`` the output gradients carry the scale ``s`` (``2¹⁶`` by default): a
    mean loss's ``1/B`` keeps them in float16's range during the model's own backward, but the
    per-sample gradients ``s · g_i`` — the mean undone (``× B``), then the products with the
    layer's inputs — often exceed float16's 65504. Lifted, the ``× B`` and the registered
    samplers' products run in float32, and ``p.grad_sample`` has the parameter's dtype, as
    ``p.grad`` has. A half-precision model (float16 parameters) keeps float16 gradients."""
    if not any(g is not None and g.dtype == torch.float16 for g in grads):
        return list(grads)
    param = next(layer.parameters(recurse=False), None)
    if param is None or param.dtype == torch.float16:
        return list(grads)
    return [g.to(torch.float32) if g is not None and g.dtype == torch.float16 else g for g in grads]


def batch_first_backprops(call: LayerCall, hooked: Sequence[int], n_outputs: int, grads,
                          scale: Optional[int] = None) -> Optional[List[Optional[torch.Tensor]]]:
    """The call's output gradients, detached, batch on dim 0 (times ``scale`` if given; None for
    an output without gradient); None if no output got one."""
    backprops: List[Optional[torch.Tensor]] = [None] * n_outputs
    for index, grad in zip(hooked, grads):
        if grad is not None:
            grad = grad.detach()
            grad = grad.movedim(call.batch_dim, 0) if call.batch_dim != 0 else grad
            backprops[index] = grad * scale if scale is not None else grad
    return None if all(b is None for b in backprops) else backprops
