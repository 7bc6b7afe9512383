"""Ghost norms and weighted gradients of ``nn.Linear`` (and the DP layers' ``BatchFirstLinear``).

Sample ``i`` has inputs ``a_t`` (rows of ``A_i``, ``T × d``) and output gradients ``g_t``
(rows of ``G_i``, ``T × p``) at its ``T`` positions (all middle dimensions flattened), so
its weight gradient is ``G_iᵀ A_i`` and (Li et al. 2022, "Large Language Models Can Be Strong
Differentially Private Learners", ghost clipping)

    ‖G_iᵀ A_i‖²_F = Σ_{t,s} (a_t · a_s)(g_t · g_s) = ⟨A_i A_iᵀ, G_i G_iᵀ⟩,

``O(T²(d + p))`` instead of ``O(T d p)``; for ``T = 1`` it is ``‖a‖² ‖g‖²``. The bias gradient
is ``Σ_t g_t``. With factors ``f_i`` the weighted sum of the per-sample weight gradients is the
batch weight gradient of the scaled output gradients: ``Σ_i f_i G_iᵀ A_i = (f ⊙ G)ᵀ A``
(one matrix product, the scale applied to the smaller of ``A`` and ``G``).
Several calls of the layer in one pass are merged by concatenating their positions.
"""

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.norm_samplers.table import register_ghost_layer, trainable
from opacus_dp.grad_sample.registry import register_norm_sampler
from opacus_dp.layers.batch_first import BatchFirstLinear

LINEAR_TYPES = [nn.Linear, BatchFirstLinear]


def _sequences(activations, backprops) -> Tuple[torch.Tensor, torch.Tensor]:
    """``A`` of shape ``(B, T, d)`` and ``G`` of shape ``(B, T, p)``."""
    g = backprops
    a = activations[0].to(g.dtype)
    batch = g.shape[0]
    return a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])


# Positions from which the Gram matrices are split into two halves of positions: by symmetry
# ⟨AAᵀ, GGᵀ⟩ = ⟨A₁A₁ᵀ, G₁G₁ᵀ⟩ + ⟨A₂A₂ᵀ, G₂G₂ᵀ⟩ + 2⟨A₁A₂ᵀ, G₁G₂ᵀ⟩, three quarters of the
# products (measured 5-10% faster at T = 128 and ~35% at T = 512 on CPU).
SPLIT_GRAM_POSITIONS = 128


def _gram_inner(a: torch.Tensor, g: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
    """``⟨A A₂ᵀ, G G₂ᵀ⟩`` per sample."""
    return (torch.bmm(a, a2.transpose(1, 2)) * torch.bmm(g, g2.transpose(1, 2))).sum(dim=(1, 2))


def gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``‖G_iᵀ A_i‖²_F`` for every ``i`` from ``A (B, T, d)``, ``G (B, T, p)`` (module doc)."""
    positions = a.shape[1]
    if positions == 1:
        return a.pow(2).sum(dim=(1, 2)) * g.pow(2).sum(dim=(1, 2))
    if positions < SPLIT_GRAM_POSITIONS:
        return _gram_inner(a, g, a, g)
    half = positions // 2
    (a1, a2), (g1, g2) = (a[:, :half], a[:, half:]), (g[:, :half], g[:, half:])
    return _gram_inner(a1, g1, a1, g1) + _gram_inner(a2, g2, a2, g2) + 2 * _gram_inner(a1, g1, a2, g2)


@register_norm_sampler(LINEAR_TYPES)
def linear_norm_sample(layer: nn.Linear, activations: List[torch.Tensor],
                       backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norms of the weight (ghost identity) and bias gradients."""
    a, g = _sequences(activations, backprops)
    norms = {}
    if trainable(layer.weight):
        norms[layer.weight] = gram_sq_norms(a, g)
    if trainable(layer.bias):
        norms[layer.bias] = g.sum(dim=1).pow(2).sum(dim=1)
    return norms


def _scaled(t: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    return t * factors.to(t.dtype).view(-1, *[1] * (t.dim() - 1))


def linear_weighted_grad(layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor,
                         factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``{weight: (f ⊙ G)ᵀ A, bias: Σ_i f_i Σ_t g_it}`` for the trainable parameters."""
    a, g = _sequences(activations, backprops)
    sums = {}
    if trainable(layer.weight) and layer.weight in factors:
        f = factors[layer.weight]
        if a.shape[-1] <= g.shape[-1]:
            a_f, g_f = _scaled(a, f), g
        else:
            a_f, g_f = a, _scaled(g, f)
        sums[layer.weight] = g_f.reshape(-1, g.shape[-1]).t().mm(a_f.reshape(-1, a.shape[-1]))
    if trainable(layer.bias) and layer.bias in factors:
        sums[layer.bias] = factors[layer.bias].to(g.dtype) @ g.sum(dim=1)
    return sums


def linear_merge_calls(layer: nn.Linear, calls: Sequence[Tuple[List[torch.Tensor], torch.Tensor]]):
    """One call with the positions of all ``calls`` concatenated (same batch)."""
    pairs = [_sequences(activations, backprops) for activations, backprops in calls]
    return [torch.cat([a for a, _ in pairs], dim=1)], torch.cat([g for _, g in pairs], dim=1)


def linear_prefers_ghost(layer: nn.Linear, activations: List[torch.Tensor]) -> bool:
    """Mixed ghost clipping rule: ghost iff ``2 T² < d · p`` (``T`` positions per sample)."""
    x = activations[0]
    positions = x[0].numel() // x.shape[-1] if x.shape[0] > 0 else 1
    return 2 * positions * positions < layer.in_features * layer.out_features


register_ghost_layer(LINEAR_TYPES, weighted_grad=linear_weighted_grad,
                     merge_calls=linear_merge_calls, prefers_ghost=linear_prefers_ghost)
