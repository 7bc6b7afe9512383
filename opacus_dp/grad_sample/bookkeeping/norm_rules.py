"""What the norms-only modes (``ghost`` / ``bk``) know of a layer type: one :class:`NormRule`
record per type in :data:`NORM_RULES`.

A layer type gets per-sample gradient *norms* without materialised per-sample gradients
when its record has both

* ``norm_sampler(layer, activations, backprops) -> {param: ‖g_i‖²}`` (or the per-sample
  gradients themselves, as ``PerSampleGrads``, for a parameter where they cost no more than the
  norm: that parameter is then kept as materialised and ``weighted_grad`` is not asked for it;
  Opacus's ``register_norm_sampler`` sets this field), and

  - ``weighted_grad(layer, activations, backprops, factors) -> {param: Σ_i f_i · g_i}``,
    the per-sample gradients of one call weighted by ``factors[param]`` (shape ``(B,)``)
    and summed over the batch, computed like the ordinary batch gradient with each
    sample's output gradient scaled (no per-sample tensor of the parameter's size);
  - ``merge_calls(layer, calls) -> (activations, backprops)`` (optional): one call
    equivalent to the ``[(activations, backprops), ...]`` of several calls of the layer in one
    backward pass (per-sample gradients add up over calls; for Linear/Embedding the
    positions are concatenated), or None if they cannot be merged. A layer called more than
    once per pass whose calls are not merged is materialised;
  - ``prefers_ghost(layer, activations) -> bool`` (optional, default True): the cost rule of
    mixed ghost clipping (Bu et al. 2022, "Scalable and Efficient Training of Large
    Convolutional Neural Networks with Differential Privacy"): the norm is computed with the
    ghost identity when that is cheaper than materialising the per-sample gradients;
  - ``materialise_if_kept(layer, activations) -> bool`` (optional, default False): when the
    ghost path would keep the call's inputs and output gradients for the clipped sum (the
    ``bk`` mode), materialise instead if this holds — e.g. per-sample gradients no larger
    than what the ghost path keeps, whose clipped sum then needs no matrix product;
  - ``chunk_grads(layer, activations, backprops) -> (params, grads(rows, out), whole)`` and
    ``prefers_chunks(layer, activations) -> bool`` (optional): with per-layer clipping on CPU,
    the per-sample gradients of a few samples at a time, written into reused buffers, clipped
    and summed at once where ``prefers_chunks`` holds (``whole``: ``{param: (B, *shape)}``
    of the small parameters, such as a bias, formed for the whole batch)
    (:mod:`~opacus_dp.grad_sample.bookkeeping.chunked_sums`);
  - ``shares_input_products`` (default False): the norm sampler takes its input Gram products
    through :func:`~opacus_dp.grad_sample.bookkeeping.shared_input_grams.input_products`, so
    that calls on the same input tensor in one backward pass compute them once.

A type with only a norm sampler is materialised by the norms-only modes.

All functions receive batch-first tensors and the output gradient of the *summed* loss; they
are linear (weighted grads) or quadratic (norms) in ``backprops``, which lets callers apply a
loss-reduction scale to the result instead of to the (large) backprops.
"""

from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, Optional, Type, Union

import torch.nn as nn

from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.grad_sample.optional_layers import LayerTable

LayerTypes = Union[Type[nn.Module], Iterable[Type[nn.Module]]]


@dataclass(frozen=True)
class NormRule:
    """Functions of one layer type for the norms-only modes (see the module doc)."""

    norm_sampler: Optional[Callable] = None
    weighted_grad: Optional[Callable] = None
    merge_calls: Optional[Callable] = None
    prefers_ghost: Optional[Callable] = None
    materialise_if_kept: Optional[Callable] = None
    chunk_grads: Optional[Callable] = None
    prefers_chunks: Optional[Callable] = None
    shares_input_products: bool = False

    @property
    def has_ghost_path(self) -> bool:
        """Norms and clipped sums without per-sample gradients (both functions present)."""
        return self.norm_sampler is not None and self.weighted_grad is not None


NORM_RULES: Dict[Type[nn.Module], NormRule] = LayerTable()  # optional libraries' types: see optional_layers


def _types(target_types: LayerTypes):
    return list(target_types) if isinstance(target_types, (list, tuple)) else [target_types]


def register_norm_rule(target_types: LayerTypes, **functions: Optional[Callable]) -> None:
    """Set the given :class:`NormRule` fields of ``target_types`` (exact types); the other
    fields keep their values."""
    for t in _types(target_types):
        NORM_RULES[t] = replace(NORM_RULES.get(t, NormRule()), **functions)


def norm_rule_of(layer: nn.Module) -> Optional[NormRule]:
    """The record of the layer's :func:`~opacus_dp.grad_sample.formula_class.formula_class` (exactly its
    type: subclasses may change ``forward``), else None."""
    return NORM_RULES.get(formula_class(layer))


class NormSamplerView(MutableMapping):
    """``{layer type: norm sampler}`` read from and written to :data:`NORM_RULES` (the
    ``NORM_SAMPLERS`` table of Opacus's API)."""

    def __getitem__(self, layer_type):
        rule = NORM_RULES.get(layer_type)
        if rule is None or rule.norm_sampler is None:
            raise KeyError(layer_type)
        return rule.norm_sampler

    def __setitem__(self, layer_type, sampler) -> None:
        register_norm_rule(layer_type, norm_sampler=sampler)

    def __delitem__(self, layer_type) -> None:
        self[layer_type]  # KeyError if absent
        register_norm_rule(layer_type, norm_sampler=None)

    def __iter__(self):
        return iter([t for t, rule in NORM_RULES.items() if rule.norm_sampler is not None])

    def __len__(self) -> int:
        return sum(rule.norm_sampler is not None for rule in NORM_RULES.values())


NORM_SAMPLERS = NormSamplerView()
