"""Registries of per-layer per-sample gradient functions.

A *grad sampler* is a pure function

    sampler(layer, activations, backprops) -> {param: per_sample_grad}

where ``activations`` is the list of positional tensor inputs of one call of ``layer``
and ``backprops`` the gradient of the loss w.r.t. that call's output, both with the batch
on dimension 0. ``per_sample_grad`` has shape ``(B, *param.shape)`` and is the gradient of
the *summed* loss restricted to sample i (the caller undoes any ``mean`` reduction).
Only parameters with ``requires_grad`` must be returned.

A *norm sampler* has the same signature but returns ``{param: per_sample_sq_norm}`` with
shape ``(B,)``: the squared L2 norm of each sample's gradient, for ghost clipping. For a
parameter whose per-sample gradients it computes in full anyway (a bias: ``Σ_t g_t``, as
small as the norms' inputs) it returns them instead, wrapped in :class:`PerSampleGrads`;
the caller then treats that parameter as materialised (norms and clipped sum from them).

A *statistics reader* ``reader(layer, output) -> tuple of tensors or None`` runs at the layer's
forward call and returns small tensors its forward saved for the backward (e.g. GroupNorm's and
LayerNorm's means and inverse deviations); the layer's grad sampler then also receives them as
``statistics=`` and need not recompute them.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Type, Union

import torch
import torch.nn as nn

from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.grad_sample.bookkeeping.norm_rules import NORM_SAMPLERS, register_norm_rule  # noqa: F401
from opacus_dp.grad_sample.optional_layers import LayerTable

GradSampler = Callable
GRAD_SAMPLERS: Dict[Type[nn.Module], GradSampler] = LayerTable()  # optional libraries' types: see optional_layers
SAVED_STATISTICS: Dict[Type[nn.Module], Callable] = {}


@dataclass(frozen=True)
class PerSampleGrads:
    """A norm sampler's result for one parameter: its per-sample gradients ``(B, *shape)``."""

    grads: torch.Tensor


def _register(table, target_types):
    types = target_types if isinstance(target_types, (list, tuple)) else [target_types]

    def decorator(fn):
        for t in types:
            table[t] = fn
        return fn

    return decorator


def register_grad_sampler(target_types: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Decorator: register ``fn`` as the per-sample gradient function of ``target_types``."""
    return _register(GRAD_SAMPLERS, target_types)


def register_norm_sampler(target_types: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Decorator: register ``fn`` as the per-sample squared-norm function of ``target_types``
    (the ``norm_sampler`` of their :class:`~opacus_dp.grad_sample.bookkeeping.norm_rules.NormRule`)."""
    def decorator(fn):
        register_norm_rule(target_types, norm_sampler=fn)
        return fn

    return decorator


def register_saved_statistics(target_types: Union[Type[nn.Module], Iterable[Type[nn.Module]]]):
    """Decorator: register ``fn`` as the statistics reader of ``target_types`` (module doc)."""
    return _register(SAVED_STATISTICS, target_types)


def find_sampler(table, layer: nn.Module):
    """The function registered in ``table`` for ``formula_class(layer)``, else None."""
    return table.get(formula_class(layer))
