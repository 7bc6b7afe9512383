"""Ghost norms and weighted gradients of ``nn.EmbeddingBag`` (each bag is one sample).

With the element weights ``w_e`` of :func:`~opacus_dp.grad_sample.embedding_bag.element_weights`
(per-sample weights, ``1/n_i`` for ``mean``, 0 at ``padding_idx``), bag ``i``'s weight gradient
in the ``sum``/``mean`` modes has the rows ``c_iv · g_i`` with ``c_iv = Σ_{e ∈ i, x_e = v} w_e``,
so

    ‖∇W_i‖²_F = ‖g_i‖² · Σ_v c_iv²          (``O(elements)``, not ``O(V · d)``).

In the ``max`` mode every output dimension ``d`` of a non-empty bag sends ``g_i[d]`` to exactly
one row, so ``‖∇W_i‖² = ‖g_i‖²`` (0 for a bag with no non-padding element). The weighted sum
``Σ_i f_i ∇W_i`` is the batch gradient with each bag's output gradient scaled by ``f_i``.
A layer called more than once in a pass is materialised.
"""

from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.embedding_bag import bag_elements, element_weights, max_winners
from opacus_dp.grad_sample.bookkeeping.norm_rules import register_norm_rule
from opacus_dp.module_parameters import trainable
from opacus_dp.grad_sample.registry import register_norm_sampler


def _call(layer: nn.EmbeddingBag, activations: List):
    indices, offsets, per_sample_weights = (list(activations) + [None, None])[:3]
    elements, bags, num_bags = bag_elements(layer, indices, offsets)
    return elements, bags, num_bags, per_sample_weights


def _non_empty(layer: nn.EmbeddingBag, elements, bags, num_bags, dtype) -> torch.Tensor:
    kept = torch.ones_like(elements, dtype=dtype) if layer.padding_idx is None else \
        (elements != layer.padding_idx).to(dtype)
    return (kept.new_zeros(num_bags).index_add_(0, bags, kept) > 0).to(dtype)


@register_norm_sampler(nn.EmbeddingBag)
def embedding_bag_norm_sample(layer: nn.EmbeddingBag, activations: List,
                              backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-bag squared norm of the weight gradient (module doc)."""
    if not trainable(layer.weight):
        return {}
    elements, bags, num_bags, per_sample_weights = _call(layer, activations)
    grad_sq = backprops.pow(2).sum(dim=1)
    if layer.mode == "max":
        return {layer.weight: grad_sq * _non_empty(layer, elements, bags, num_bags, backprops.dtype)}
    weights = element_weights(layer, elements, bags, num_bags, per_sample_weights, backprops.dtype)
    unique_keys, inverse = torch.unique(bags * layer.num_embeddings + elements, return_inverse=True)
    coefficients = weights.new_zeros(unique_keys.shape[0]).index_add_(0, inverse, weights)
    owner = torch.div(unique_keys, layer.num_embeddings, rounding_mode="floor")
    per_bag = weights.new_zeros(num_bags).index_add_(0, owner, coefficients.pow(2))
    return {layer.weight: grad_sq * per_bag}


def embedding_bag_weighted_grad(layer: nn.EmbeddingBag, activations: List, backprops: torch.Tensor,
                                factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``Σ_i f_i ∇W_i``: the batch gradient of the bags' output gradients scaled by ``f_i``."""
    if not trainable(layer.weight) or layer.weight not in factors:
        return {}
    elements, bags, num_bags, per_sample_weights = _call(layer, activations)
    scaled = backprops * factors[layer.weight].to(backprops.dtype).unsqueeze(1)
    total = backprops.new_zeros(layer.weight.shape)
    if layer.mode == "max":
        winners, found = max_winners(layer, elements, bags, num_bags)
        return {layer.weight: total.scatter_add_(0, winners, scaled * found.to(scaled.dtype))}
    weights = element_weights(layer, elements, bags, num_bags, per_sample_weights, backprops.dtype)
    return {layer.weight: total.index_add_(0, elements, scaled[bags] * weights.unsqueeze(1))}


register_norm_rule(nn.EmbeddingBag, weighted_grad=embedding_bag_weighted_grad)
