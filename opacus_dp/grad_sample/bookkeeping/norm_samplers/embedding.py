"""Ghost norms and weighted gradients of ``nn.Embedding`` (index matching).

Sample ``i`` with indices ``x_t`` and output gradients ``g_t`` has the weight gradient
``Σ_t s_t e_{x_t} g_tᵀ`` (``e_v`` the ``v``-th unit vector; ``s_t = 0`` at ``padding_idx``;
``s_t = 1 / #{u : x_u = x_t}`` with ``scale_grad_by_freq``, counted within the sample), so

    ‖∇W_i‖²_F = Σ_v ‖Σ_{t : x_t = v} s_t g_t‖²,

the rows of the sample's gradient that are not zero. They are found by matching indices
(one sort of the ``B · T`` keys ``i · V + x_t``), never forming the ``V × d`` per-sample table:
``O(B T d)`` memory instead of ``O(B V d)``. This equals the ghost identity
``Σ_{t,u} [x_t = x_u] s_t s_u (g_t · g_u)`` (Li et al. 2022). The weighted sum
``Σ_i f_i ∇W_i`` scatters ``f_i s_t g_t`` to row ``x_t``, as the batch backward does.
Calls in one pass are merged by concatenating positions (not with ``scale_grad_by_freq``).
"""

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.embedding import sample_row_index
from opacus_dp.grad_sample.bookkeeping.norm_rules import register_norm_rule
from opacus_dp.grad_sample.bookkeeping.norm_samplers.trust import bound_sq, trusted_sq_norms
from opacus_dp.module_parameters import trainable
from opacus_dp.grad_sample.registry import register_norm_sampler


def _flat_indices_and_grads(layer: nn.Embedding, activations, backprops):
    """``(keys i·V + x_t  (B·T,), scaled gradients s_t g_t  (B·T, d))``."""
    indices = activations[0]
    batch = indices.shape[0]
    keys = sample_row_index(indices.reshape(batch, -1), layer.num_embeddings).reshape(-1)
    grads = backprops.reshape(-1, layer.embedding_dim)
    scale = None
    if layer.padding_idx is not None:
        scale = (indices.reshape(-1) != layer.padding_idx).to(grads.dtype)
    if layer.scale_grad_by_freq:
        _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        inv_freq = 1.0 / counts[inverse].to(grads.dtype)
        scale = inv_freq if scale is None else scale * inv_freq
    if scale is not None:
        grads = grads * scale.unsqueeze(1)
    return keys, grads


@register_norm_sampler(nn.Embedding)
def embedding_norm_sample(layer: nn.Embedding, activations: List[torch.Tensor],
                          backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norm of the weight gradient by index matching (module doc)."""
    if not trainable(layer.weight):
        return {}
    batch = activations[0].shape[0]
    keys, grads = _flat_indices_and_grads(layer, activations, backprops)
    unique_keys, inverse = torch.unique(keys, return_inverse=True)
    rows = grads.new_zeros(unique_keys.shape[0], layer.embedding_dim).index_add_(0, inverse, grads)
    owner = torch.div(unique_keys, layer.num_embeddings, rounding_mode="floor")
    sq_norms = grads.new_zeros(batch).index_add_(0, owner, rows.pow(2).sum(dim=1))
    return {layer.weight: _with_margin_where_rows_cancel(sq_norms, grads, batch)}


def _with_margin_where_rows_cancel(sq_norms: torch.Tensor, grads: torch.Tensor, batch: int) -> torch.Tensor:
    """The rows' norms are exact sums, but the weighted sum scatters the positions again, whose
    rounding grows with ``N = Σ_t ‖s_t g_t‖``: where positions of a row cancel (``N > 16 n``),
    the norm gets the margin of
    :func:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.trust.trusted_sq_norms`."""
    if batch == 0:
        return sq_norms
    positions = grads.shape[0] // batch
    bounds = bound_sq(grads.norm(dim=1).view(batch, positions))
    return trusted_sq_norms(sq_norms, bounds, lambda index: (sq_norms[index].double(), bounds[index]),
                            positions)


def embedding_weighted_grad(layer: nn.Embedding, activations: List[torch.Tensor],
                            backprops: torch.Tensor,
                            factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``Σ_i f_i ∇W_i``: ``f_i s_t g_t`` added to row ``x_t``."""
    if not trainable(layer.weight) or layer.weight not in factors:
        return {}
    indices = activations[0]
    batch = indices.shape[0]
    keys, grads = _flat_indices_and_grads(layer, activations, backprops)
    per_position = factors[layer.weight].to(grads.dtype).repeat_interleave(keys.shape[0] // max(batch, 1))
    rows = torch.remainder(keys, layer.num_embeddings)
    total = grads.new_zeros(layer.num_embeddings, layer.embedding_dim)
    return {layer.weight: total.index_add_(0, rows, grads * per_position.unsqueeze(1))}


def embedding_merge_calls(layer: nn.Embedding, calls: Sequence[Tuple[List[torch.Tensor], torch.Tensor]]):
    """One call with the positions of all ``calls`` concatenated (same batch); None with
    ``scale_grad_by_freq`` (torch counts frequencies per call, not over all calls)."""
    if layer.scale_grad_by_freq:
        return None
    batch = calls[0][1].shape[0]
    indices = torch.cat([a[0].reshape(batch, -1) for a, _ in calls], dim=1)
    grads = torch.cat([g.reshape(batch, -1, g.shape[-1]) for _, g in calls], dim=1)
    return [indices], grads


def embedding_prefers_ghost(layer: nn.Embedding, activations: List[torch.Tensor]) -> bool:
    """Index matching costs ``O(T d)`` per sample, the per-sample table ``O(V d)``: ghost iff ``T < V``."""
    x = activations[0]
    positions = x[0].numel() if x.shape[0] > 0 and x.dim() > 1 else 1
    return positions < layer.num_embeddings


register_norm_rule(nn.Embedding, weighted_grad=embedding_weighted_grad,
                     merge_calls=embedding_merge_calls, prefers_ghost=embedding_prefers_ghost)
