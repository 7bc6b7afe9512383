"""Opacus 1.6's ``torch.func`` helpers (``opacus.grad_sample.functorch``), for code that calls them.

For a layer ``f(θ, x)`` with the gradient ``g`` of the loss w.r.t. its output, the per-sample
gradient of sample ``i`` is the vector-Jacobian product

    ∂L_i/∂θ = ∂/∂θ  Σ( f(θ, x_i) ⊙ g_i ) ,

formed for every ``i`` at once by ``vmap(grad(.))`` over the batch (exact when output row ``i``
depends only on input row ``i``). opacus_dp's own fallback for layers without a grad sampler is
:func:`~opacus_dp.grad_sample.functorch_fallback.functorch_grad_sample`; these three functions keep
Opacus's signatures: one positional input, all of the layer's parameters (recursively),
and the callable stored on the layer as ``layer.ft_compute_sample_grad``.
"""

import copy
from contextlib import nullcontext
from typing import Callable, Dict, Sequence, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.layers.batch_first import BatchFirstLinear

__all__ = ["make_functional", "prepare_layer", "ft_compute_per_sample_gradient"]


def make_functional(mod: nn.Module, disable_autograd_tracking: bool = False) -> Tuple[Callable, Tuple]:
    """``(fmodel, params)``: ``fmodel(params, *args, **kwargs)`` runs ``mod``'s forward with the
    tensors ``params`` (in ``mod.named_parameters()`` order) in place of its parameters;
    ``params`` are ``mod``'s own parameters (detached if ``disable_autograd_tracking``).
    ``fmodel`` calls a copy of ``mod`` on the ``meta`` device, so ``mod`` itself is not used."""
    names = [name for name, _ in mod.named_parameters()]
    values = tuple(p for _, p in mod.named_parameters())
    stateless = copy.deepcopy(mod).to("meta")

    def fmodel(new_values: Sequence[torch.Tensor], *args, **kwargs):
        if len(new_values) != len(names):
            raise ValueError(f"make_functional: fmodel takes {len(names)} parameter tensors "
                             f"(mod.named_parameters() order), got {len(new_values)}")
        return functional_call(stateless, dict(zip(names, new_values)), args, kwargs)

    if disable_autograd_tracking:
        values = tuple(v.detach() for v in values)
    return fmodel, values


def _refuse_unsupported(layer: nn.Module) -> None:
    """Opacus 1.6's refusals: a layer with buffers, and ``nn.EmbeddingBag``."""
    if len(list(layer.buffers())) > 0:
        raise NotImplementedError(
            f"prepare_layer: {type(layer).__name__} has buffers, which the functional recomputation "
            f"does not carry; register a grad sampler for it (register_grad_sampler)")
    if formula_class(layer) is nn.EmbeddingBag:
        raise NotImplementedError(
            "prepare_layer: nn.EmbeddingBag is not supported by torch.func here; its grad sampler "
            "(GradSampleModule) handles it")


def prepare_layer(layer: nn.Module, batch_first: bool = True) -> None:
    """Store on ``layer`` the function ``layer.ft_compute_sample_grad(params, activations, backprops)``
    returning, per parameter of ``layer.parameters()``, its per-sample gradients (batch on dim 0).

    ``activations`` and ``backprops`` carry the batch on dimension 0; each sample is put back at
    the batch position the layer expects (dimension 1 when ``batch_first`` is False, except for a
    ``BatchFirstLinear``/``RNNLinear``). Activations of a lower floating dtype than the parameters
    are run under ``torch.autocast`` of that dtype (mixed precision)."""
    _refuse_unsupported(layer)
    flayer, _ = make_functional(layer)
    dim = 0 if batch_first or isinstance(layer, BatchFirstLinear) else 1

    def sample_loss(params, activation, backprop):
        mixed = activation.dtype != params[0].dtype
        context = torch.autocast(device_type=activation.device.type, dtype=activation.dtype) if mixed \
            else nullcontext()
        with context:
            output = flayer(params, activation.unsqueeze(dim))
            return (output * backprop.unsqueeze(dim)).sum()

    layer.ft_compute_sample_grad = vmap(grad(sample_loss), in_dims=(None, 0, 0))


def ft_compute_per_sample_gradient(layer: nn.Module, activations: Sequence[torch.Tensor],
                                   backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """``{p: per-sample gradients of p}`` for every parameter ``p`` of ``layer`` (recursively);
    ``activations[0]`` is the layer's input, ``backprops`` the gradient of the loss w.r.t. its
    output, both with the batch on dimension 0. Calls :func:`prepare_layer` (batch first) on
    the first use; a floating input is cast to ``backprops``' dtype."""
    parameters = list(layer.parameters(recurse=True))
    if not hasattr(layer, "ft_compute_sample_grad"):
        prepare_layer(layer)
    activation = activations[0]
    if activation.is_floating_point() and activation.dtype != backprops.dtype:
        activation = activation.to(backprops.dtype)
    per_sample = layer.ft_compute_sample_grad(parameters, activation, backprops)
    return dict(zip(parameters, per_sample))
