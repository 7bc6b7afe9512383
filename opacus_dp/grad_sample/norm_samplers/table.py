"""What the norms-only modes (``ghost`` / ``bk``) need from a layer type, besides its norm sampler.

A layer type gets per-sample gradient *norms* without materialised per-sample gradients
when it has

* a norm sampler in :data:`opacus_dp.grad_sample.registry.NORM_SAMPLERS`
  (``(layer, activations, backprops) -> {param: ‖g_i‖²}``, or the per-sample gradients
  themselves, as ``PerSampleGrads``, for a parameter where they cost no more than the norm:
  that parameter is then kept as materialised and ``weighted_grad`` is not asked for it), and
* a :class:`GhostLayer` entry here:

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
    (:mod:`~opacus_dp.grad_sample.chunked_sums`).

All functions receive batch-first tensors and the output gradient of the *summed* loss; they
are linear (weighted grads) or quadratic (norms) in ``backprops``, which lets callers apply a
loss-reduction scale to the result instead of to the (large) backprops.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Type, Union

import torch.nn as nn


@dataclass(frozen=True)
class GhostLayer:
    """Functions of one layer type for the norms-only modes (see the module doc)."""

    weighted_grad: Callable
    merge_calls: Optional[Callable] = None
    prefers_ghost: Optional[Callable] = None
    materialise_if_kept: Optional[Callable] = None
    chunk_grads: Optional[Callable] = None
    prefers_chunks: Optional[Callable] = None


GHOST_LAYERS: Dict[Type[nn.Module], GhostLayer] = {}


def register_ghost_layer(target_types: Union[Type[nn.Module], Iterable[Type[nn.Module]]], *,
                         weighted_grad: Callable, merge_calls: Optional[Callable] = None,
                         prefers_ghost: Optional[Callable] = None,
                         materialise_if_kept: Optional[Callable] = None,
                         chunk_grads: Optional[Callable] = None,
                         prefers_chunks: Optional[Callable] = None) -> None:
    """Register the :class:`GhostLayer` functions of ``target_types`` (exact types)."""
    types = target_types if isinstance(target_types, (list, tuple)) else [target_types]
    for t in types:
        GHOST_LAYERS[t] = GhostLayer(weighted_grad, merge_calls, prefers_ghost, materialise_if_kept,
                                     chunk_grads, prefers_chunks)


def ghost_layer_of(layer: nn.Module) -> Optional[GhostLayer]:
    """The entry of exactly ``type(layer)`` (subclasses may change ``forward``), else None."""
    return GHOST_LAYERS.get(type(layer))

