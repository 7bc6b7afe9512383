"""Per-sample gradients of ``nn.EmbeddingBag`` (each bag is one sample).

Bag ``i`` holds the indices ``x_e`` of its elements ``e`` (2-D input: one row per bag;
1-D input: the slices between ``offsets``, with ``include_last_offset`` honoured).
With output gradient ``g_i`` of bag ``i`` and padding elements (``x_e = padding_idx``)
left out of the bag entirely:

* ``sum``:  dL_i/dW[v] = sum_{e in i, x_e = v} w_e g_i      (``w_e`` = per_sample_weights, else 1)
* ``mean``: dL_i/dW[v] = sum_{e in i, x_e = v} g_i / n_i     (``n_i`` = non-padding elements)
* ``max``:  dL_i/dW[v, d] = g_i[d] if v is the index of the first element of bag ``i``
  attaining ``max_e W[x_e, d]``, else 0.

With ``scale_grad_by_freq=True`` (``sum``/``mean``) each element's term is also divided by the
number of elements of bag ``i`` with the same index (frequencies counted inside the sample, as
a batch of that bag alone would do; torch counts them over the whole batch).

Empty bags give zero gradients.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.maths.huge_pages import zeros_on_huge_pages


def bag_elements(
    layer: nn.EmbeddingBag, indices: torch.Tensor, offsets: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(element indices, bag of each element, number of bags)`` of one call."""
    if indices.dim() == 2:
        num_bags, per_bag = indices.shape
        bags = torch.arange(num_bags, device=indices.device).repeat_interleave(per_bag)
        return indices.reshape(-1), bags, num_bags
    if offsets is None:
        raise ValueError("nn.EmbeddingBag with 1-D input needs offsets")
    total = torch.tensor([indices.shape[0]], device=offsets.device, dtype=offsets.dtype)
    bounds = offsets if layer.include_last_offset else torch.cat([offsets, total])
    lengths = bounds[1:] - bounds[:-1]
    num_bags = lengths.shape[0]
    bags = torch.arange(num_bags, device=indices.device).repeat_interleave(lengths)
    start = int(bounds[0])
    return indices[start : start + bags.shape[0]], bags, num_bags


def element_weights(layer, elements, bags, num_bags, per_sample_weights, dtype):
    """Weight of each element in its bag's output (0 for padding)."""
    if per_sample_weights is None:
        weights = torch.ones(elements.shape, dtype=dtype, device=elements.device)
    else:
        weights = per_sample_weights.reshape(-1)[: elements.shape[0]].to(dtype)
    if layer.padding_idx is not None:
        weights = weights * (elements != layer.padding_idx).to(dtype)
    if layer.mode == "mean":
        kept = (weights != 0).to(dtype) if layer.padding_idx is not None else torch.ones_like(weights)
        sizes = torch.zeros(num_bags, dtype=dtype, device=elements.device).index_add_(0, bags, kept)
        weights = weights / sizes.clamp(min=1)[bags]
    if layer.scale_grad_by_freq:  # 1 / (occurrences of the index in its own bag)
        _, inverse, counts = torch.unique(bags * layer.num_embeddings + elements,
                                          return_inverse=True, return_counts=True)
        weights = weights / counts[inverse].to(dtype)
    return weights


def max_winners(layer, elements, bags, num_bags) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per (bag, dim): the index attaining the bag's max, and whether the bag is non-empty."""
    values = layer.weight.detach()[elements]
    if layer.padding_idx is not None:
        values = values.masked_fill((elements == layer.padding_idx).unsqueeze(1), float("-inf"))
    spread = bags.unsqueeze(1).expand_as(values)
    maxima = values.new_full((num_bags, values.shape[1]), float("-inf"))
    maxima.scatter_reduce_(0, spread, values, reduce="amax")
    count = elements.shape[0]
    position = torch.arange(count, device=elements.device).unsqueeze(1).expand_as(values)
    candidate = torch.where((values == maxima[bags]) & (values > float("-inf")), position, count)
    first = torch.full_like(maxima, count, dtype=torch.long)
    first.scatter_reduce_(0, spread, candidate, reduce="amin")
    found = first < count
    padded = torch.cat([elements, elements.new_zeros(1)])
    return padded[first], found


@register_grad_sampler(nn.EmbeddingBag)
def embedding_bag_grad_sample(
    layer: nn.EmbeddingBag, activations: List, backprops: torch.Tensor
) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample gradient of ``layer.weight``; activations = [input, offsets, per_sample_weights]."""
    if not layer.weight.requires_grad:
        return {}
    indices, offsets, per_sample_weights = (list(activations) + [None, None])[:3]
    elements, bags, num_bags = bag_elements(layer, indices, offsets)
    num_rows, dim = layer.weight.shape
    grad_sample = zeros_on_huge_pages((num_bags * num_rows, dim), backprops.dtype, backprops.device)
    if layer.mode == "max":
        winners, found = max_winners(layer, elements, bags, num_bags)
        rows = winners + torch.arange(num_bags, device=winners.device).unsqueeze(1) * num_rows
        grad_sample.scatter_add_(0, rows, backprops * found.to(backprops.dtype))
    else:
        weights = element_weights(
            layer, elements, bags, num_bags, per_sample_weights, backprops.dtype
        )
        rows = bags * num_rows + elements
        grad_sample.index_add_(0, rows, backprops[bags] * weights.unsqueeze(1))
    return {layer.weight: grad_sample.view(num_bags, num_rows, dim)}
